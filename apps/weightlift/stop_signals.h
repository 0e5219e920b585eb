// The stop signals (SIGINT, SIGTERM, SIGHUP) are taken by one thread of their own, never by a
// thread that computes: on the machines this project runs on, a signal handler run on a thread
// in the middle of its kernels corrupts that thread's work (a heap corrupted, or a NaN gradient,
// within about 100 signals to an empty handler; docs/algorithms.md). route_stop_signals() blocks
// them before any other thread exists, so that every thread inherits the block, and starts the one
// thread that waits for them (sigwait).
//
// What a stop signal does: one a command catches (catch_stop_signals) is recorded for the command
// to act on at its next look (stop_signal(): the first that came); the same signal again, or
// one not caught, ends the process by the signal, as if nothing caught it.
#pragma once

#include <atomic>
#include <initializer_list>
#include <string>

namespace wl::app {

// First thing in main(), before any thread is started.
void route_stop_signals();

// From now on, the first of `signals` is recorded rather than ending the process.
void catch_stop_signals(std::initializer_list<int> signals);

// The signal that asked the process to stop, 0 before one.
const std::atomic<int>& stop_signal();

// "SIGTERM", "SIGINT", "SIGHUP" or "signal N".
std::string stop_signal_name(int sig);

}  // namespace wl::app
