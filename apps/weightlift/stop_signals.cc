#include "stop_signals.h"

#include <csignal>

namespace wl::app {
namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);
extern "C" void record_stop_signal(int sig) { g_stop_signal.store(sig); }

}  // namespace

void catch_stop_signals(std::initializer_list<int> signals) {
  struct sigaction sa {};
  sa.sa_handler = record_stop_signal;
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
  for (int sig : signals) ::sigaction(sig, &sa, nullptr);
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
