// Pieces the ring algorithms share: how a buffer is cut into one block per rank and each block
// into pipeline segments, and the two ring passes that allreduce, reduce_scatter and allgather
// are built from (reduce_scatter_ring.cc, allgather_ring.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm::detail {

// Default pipeline segment. Large enough that per-message overhead (a few microseconds) is
// small against the copy (256 KiB at ~10 GB/s is ~25 us), small enough that a 4-rank ring of
// a few MiB still has several segments per block to overlap.
inline constexpr size_t kDefaultSegmentBytes = 256 << 10;

// Blocks of a buffer, in elements: block b is [offsets[b], offsets[b] + counts[b]).
struct Blocks {
  std::vector<size_t> offsets;
  std::vector<size_t> counts;
  size_t max_count() const;
};

// `count` elements in `parts` blocks as even as can be: the first count % parts blocks have
// one element more.
Blocks even_blocks(size_t count, int parts);
// Blocks of the given sizes, laid out one after another.
Blocks blocks_from_counts(const std::vector<size_t>& counts);

// Elements per segment for `segment_bytes` (0: the default), at least 1.
size_t segment_elements(size_t segment_bytes, DType dtype);
inline size_t num_segments(size_t count, size_t seg) { return (count + seg - 1) / seg; }

struct RingReduceScatter {
  const void* in = nullptr;  // this rank's contribution: all blocks
  void* work = nullptr;      // all blocks; partial sums land here; may equal `in`
  // Where this rank's finished block goes (may be inside `work`).
  void* out = nullptr;
  const Blocks* blocks = nullptr;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;  // kAvg reduces as kSum; the caller divides
  size_t segment_elems = 1;
  uint32_t sequence = 0;
  uint32_t first_step = 0;  // step numbers used: first_step .. first_step + P - 2
};

// Rank r ends with block r reduced over all ranks, in `out`.
Status ring_reduce_scatter(Group& group, const RingReduceScatter& args, Deadline deadline);

struct RingAllgather {
  void* buffer = nullptr;  // all blocks; this rank's block is already in place
  const Blocks* blocks = nullptr;
  size_t elem_size = 1;
  size_t segment_elems = 1;
  uint32_t sequence = 0;
  uint32_t first_step = 0;  // step numbers used: first_step .. first_step + P - 2
};

// Every rank ends with every block.
Status ring_allgather(Group& group, const RingAllgather& args, Deadline deadline);

// Step tag for segment k of ring step s: unique while the collective has < 65536 segments in
// all, and harmless past that because matching within a tag follows send order.
inline uint32_t step_tag(uint32_t step, size_t segments_per_step, size_t k) {
  return uint32_t(step * segments_per_step + k);
}

}  // namespace wl::comm::detail
