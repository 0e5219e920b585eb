#include "weightlift/comm/launch/process_alive.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <functional>
#include <string>

namespace wl::comm {

ProcessId this_process() {
  static const uint64_t host = [] {
    std::string id;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> id;
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    const uint64_t h = std::hash<std::string>()(id + "/" + name);
    return h == 0 ? 1 : h;
  }();
  return {host, int64_t(::getpid())};
}

bool process_may_be_alive(const ProcessId& p) {
  if (p.host == 0 || p.pid <= 0 || p.host != this_process().host) return true;
  return ::kill(pid_t(p.pid), 0) == 0 || errno != ESRCH;
}

}  // namespace wl::comm
