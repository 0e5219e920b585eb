// The allreduce algorithms behind allreduce() (allreduce.cc picks one). Arguments are
// already validated; `in` may equal `out` (in place), `count` > 0.
#pragma once

#include "weightlift/comm/allreduce.h"

namespace wl::comm::detail {

struct AllreduceArgs {
  const void* in = nullptr;  // count elements
  void* out = nullptr;       // count elements
  size_t count = 0;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  size_t segment_bytes = 0;
  uint32_t sequence = 0;
};

Status allreduce_ring(Group& group, const AllreduceArgs& args, Deadline deadline);
Status allreduce_recursive_doubling(Group& group, const AllreduceArgs& args, Deadline deadline);
class ShmArena;
Status allreduce_shm(Group& group, ShmArena& arena, const AllreduceArgs& args, Deadline deadline);

}  // namespace wl::comm::detail
