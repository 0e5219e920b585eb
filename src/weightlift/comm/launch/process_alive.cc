#include "weightlift/comm/launch/process_alive.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include "weightlift/comm/group/group.h"

namespace wl::comm {

ProcessId this_process() { return {this_host(), int64_t(::getpid())}; }

bool process_may_be_alive(const ProcessId& p) {
  if (p.host == 0 || p.pid <= 0 || p.host != this_process().host) return true;
  return ::kill(pid_t(p.pid), 0) == 0 || errno != ESRCH;
}

}  // namespace wl::comm
