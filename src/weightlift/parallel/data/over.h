// Which ranks a collective of the data-parallel layer spans (unit_parts.h, comm_queue.h).
#pragma once

#include <cstdint>

namespace wl::parallel {

// The stage's data-parallel ranks, or, for a run of experts under expert parallelism, the
// data-parallel ranks that hold the same experts (one per expert group).
enum class Over : uint8_t { kData, kExpertData };

}  // namespace wl::parallel
