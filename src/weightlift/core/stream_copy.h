// Copies into memory that another core or process reads next (a peer's shared-memory block, a
// receiver's slot mapped into a trainer). Non-temporal stores write whole cache lines without
// reading them for ownership first, so a copy moves two bytes of DRAM traffic per byte instead
// of three, and leaves this core's caches to what it works on. The medium bf16 weight update
// went from 0.83 to 0.97-1.12 of single-thread memcpy with them (docs/BENCHMARKS.md).
#pragma once

#include <cstddef>

namespace wl {

// memcpy with non-temporal stores (SSE2: any x86-64). They are not ordered with this thread's
// later stores: call store_fence() before whatever tells another process the bytes are there.
void stream_copy(std::byte* dst, const std::byte* src, size_t bytes);

// Orders every earlier store of this thread, streaming ones included, before its later ones
// (SFENCE).
void store_fence();

}  // namespace wl
