#include "stop_signals.h"

#include <pthread.h>

#include <csignal>
#include <cstdlib>
#include <thread>

namespace wl::app {
namespace {

std::atomic<int> g_stop_signal{0};
std::atomic<unsigned> g_caught{0};  // bit `sig` set: catch_stop_signals() took it

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  return set;
}

// Ends the process by `sig` as its default action would: unblocked on this thread alone and
// raised to it.
[[noreturn]] void die_of(int sig) {
  std::signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  std::raise(sig);
  std::_Exit(128 + sig);
}

// The first of a caught signal is recorded (the first of all is the one stop_signal() says);
// the second of the same kind, or one not caught, ends the process.
void take_stop_signals(sigset_t set) {
  unsigned seen = 0;
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    const unsigned bit = 1u << sig;
    if (!(g_caught.load() & bit) || (seen & bit)) die_of(sig);
    seen |= bit;
    int none = 0;
    g_stop_signal.compare_exchange_strong(none, sig);
  }
}

}  // namespace

void route_stop_signals() {
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(take_stop_signals, set).detach();
}

void catch_stop_signals(std::initializer_list<int> signals) {
  for (int sig : signals) g_caught.fetch_or(1u << sig);
}

const std::atomic<int>& stop_signal() { return g_stop_signal; }

std::string stop_signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "signal " + std::to_string(sig);
  }
}

}  // namespace wl::app
