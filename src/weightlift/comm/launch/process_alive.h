// Whether a process on this host still exists, asked before unpacking its rkey.
//
// UCX 1.13 crashes, instead of returning an error, when an rkey for shared memory whose owner
// has exited is unpacked (the shmat fails and its cleanup frees what it never set; fixed in
// UCX by openucx/ucx#10380). A peer that might have died (a receiver between metadata and
// its first update, a healing source) is therefore checked here first; what remains is the
// window between this check and the unpack.
#pragma once

#include <cstdint>

namespace wl::comm {

// This process's identity: its host (comm::this_host(), group/group.h) and its pid.
struct ProcessId {
  uint64_t host = 0;
  int64_t pid = 0;
};
ProcessId this_process();

// False only when `p` is on this host and no process has its pid; true otherwise (another
// host, or unknown: host 0).
bool process_may_be_alive(const ProcessId& p);

}  // namespace wl::comm
