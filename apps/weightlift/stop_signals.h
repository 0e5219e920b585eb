// The stop signals of the commands that end cleanly when asked (launch, receiver, rl): the
// first SIGINT, SIGTERM or SIGHUP is recorded for the command to act on at its next look; the
// second kills (SA_RESETHAND), for a process that does not stop soon enough.
#pragma once

#include <atomic>
#include <initializer_list>
#include <string>

namespace wl::app {

// Catches `signals` from now on. SA_RESTART: the calls a signal lands in go on.
void catch_stop_signals(std::initializer_list<int> signals);

// The signal that asked the process to stop, 0 before one. Stored from the handler (a lock-free
// atomic, safe from whichever thread the signal lands on).
const std::atomic<int>& stop_signal();

// "SIGTERM", "SIGINT", "SIGHUP" or "signal N".
std::string stop_signal_name(int sig);

}  // namespace wl::app
