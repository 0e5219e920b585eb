// reduce: the element-wise reduction of every rank's buffer, on the root only. A binomial
// tree (reduce_binomial.cc): ceil(log2 P) steps, each halving the ranks still holding data.
#pragma once

#include <chrono>
#include <cstddef>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

struct ReduceOptions {
  const void* send = nullptr;  // count elements; null: in place in recv (root only)
  void* recv = nullptr;        // count elements, root only (ignored elsewhere)
  size_t count = 0;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::chrono::milliseconds timeout{0};
};

Status reduce(Group& group, const ReduceOptions& options);

}  // namespace wl::comm
