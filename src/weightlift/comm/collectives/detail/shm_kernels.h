// The loops the shared-memory collectives (allreduce_shm.cc) spend their time in: copies, with
// or without streaming stores, and the last step of a reduction, which writes its result to the
// rank's result block (for the peers) and to its output.
//
// When either is streamed (the output from 8 MiB, a slot when the rank chose to), both are
// written from the same registers in one pass, with AVX-512 or AVX2 for f32 sums: the SSE loops the
// compiler makes from the portable kernels (reduce_op.cc) keep too few cache misses in flight to
// read DRAM at the copy rate. On one core a 32 MiB f32 sum made once and then copied out
// took 4.2-4.7 ms, written both ways at once 2.7-2.9 ms; the 2-rank allreduce of 8-256 MiB
// got 1.10-1.22x faster by median (docs/BENCHMARKS.md, "One pass for the reduction"). When the
// result stays in cache the one pass was slower (0.6x at 64-128 KiB): the result is made once and
// copied, as before.
#pragma once

#include <cstddef>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/core/dtype.h"

namespace wl::comm::detail {

// memcpy, or with non-temporal stores when `stream` (SSE2, so any x86-64). Streaming stores
// are not ordered with later stores: the caller fences before anything that publishes the data.
void copy_bytes(std::byte* dst, const std::byte* src, size_t bytes, bool stream);

// Where a reduction writes its result.
struct ReduceDestination {
  std::byte* at = nullptr;  // none when null
  bool stream = false;      // with non-temporal stores
};

// first[i] = second[i] = a[i] op b[i] for i < count, then divided by `divisor` when op is
// kAvg and divisor > 1 (the pipeline passes P: this is the step that adds the last peer's
// values, and the earlier steps are plain reduce() calls). The same bits as reduce() followed
// by divide(), whichever loop runs. With a streamed destination, f32 sums use AVX-512 or AVX2
// when the CPU has them, and everything else reduces L1-sized pieces with reduce() and copies
// each piece to both destinations. `second.at` may be null. a or b may be a destination (in
// place), but must not overlap one otherwise.
void reduce_to(DType dtype, ReduceOp op, ReduceDestination first, ReduceDestination second,
               const std::byte* a, const std::byte* b, size_t count, int divisor);

// The loops reduce_to can take for f32 sums; it takes the widest this CPU has. Tests ask for
// each one the CPU has, to compare them with the portable one bit for bit.
enum class VectorWidth { kPortable, kAvx2, kAvx512 };
VectorWidth widest_vector_width();
void reduce_to(VectorWidth width, DType dtype, ReduceOp op, ReduceDestination first,
               ReduceDestination second, const std::byte* a, const std::byte* b, size_t count,
               int divisor);

}  // namespace wl::comm::detail
