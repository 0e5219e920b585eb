// Memory before allocation: how much this process may use, and refusing work whose estimate
// exceeds it before anything is allocated.
//
// A config with hidden_size 1e9, a plan for a million receivers or a 1 TiB collective sweep
// would otherwise run until an allocation fails somewhere deep inside (a std::bad_alloc from
// a constructor, or the kernel's OOM killer), after minutes of work and with a message that
// says nothing about why. Each layer that is about to allocate in proportion to something a
// user chose estimates the bytes (at least what it will certainly hold: the estimates are
// lower bounds, so nothing that fits is refused) and calls check_memory first.
//
// The limit is the smallest of: the machine's physical memory, the process's address-space
// and data limits (RLIMIT_AS, RLIMIT_DATA) and its cgroup's memory.max; or, when set, the
// user's own budget (set_memory_budget; `weightlift --max-memory`), which replaces them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "weightlift/core/status.h"

namespace wl {

struct MemoryLimit {
  uint64_t bytes = 0;
  // "physical memory", "RLIMIT_AS", "cgroup memory.max", or "`memory_budget`" (the user's,
  // set_memory_budget: messages name it as an option field, for the command line to map).
  std::string source;
};

// Whose memory an estimate is: this process's, or that of several processes of one host
// together (RLIMIT_AS and RLIMIT_DATA bound each process, not their sum).
enum class MemoryScope { kProcess, kHost };

// The limit in force now (read each call: limits can change).
MemoryLimit memory_limit(MemoryScope scope = MemoryScope::kProcess);

// A budget of the user's instead of the machine's (0: the machine's again). Process-wide, as
// the compute pool's thread count is: `weightlift --max-memory` sets it before a command runs.
void set_memory_budget(uint64_t bytes);

// ResourceExhausted when `bytes` exceed the limit:
//   "out of memory: training 'medium' needs at least 6.7 GB (parameters, gradients and AdamW
//    moments 6.7 GB), more than the 1.5 GB RLIMIT_AS allows; lower the sizes or raise the
//    limit (`memory_budget`)"
// `what` says what needs them, `detail` (may be empty) how the estimate is made up.
Status check_memory(uint64_t bytes, std::string_view what, std::string_view detail = {},
                    MemoryScope scope = MemoryScope::kProcess);

// a * b, saturating at UINT64_MAX: estimates multiply user-chosen sizes that may overflow.
uint64_t mul_sat(uint64_t a, uint64_t b);
uint64_t add_sat(uint64_t a, uint64_t b);

// "6.7 GB", "512 MB", "4.2 kB", "17 B": decimal, three significant digits, for messages.
std::string format_bytes(uint64_t bytes);

}  // namespace wl
