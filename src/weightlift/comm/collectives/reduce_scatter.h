// reduce_scatter: rank r ends with block r of the element-wise reduction; each rank gives
// size * count elements and gets count back. The ring (reduce_scatter_ring.cc) does it in
// P-1 steps of one block each.
#pragma once

#include <chrono>
#include <cstddef>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

struct ReduceScatterOptions {
  const void* send = nullptr;  // size * count elements: block b goes to rank b
  void* recv = nullptr;        // count elements; may be send + rank * count (in place)
  size_t count = 0;            // elements per rank
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout{0};
  size_t segment_bytes = 0;  // 0: the default
};

Status reduce_scatter(Group& group, const ReduceScatterOptions& options);

}  // namespace wl::comm
