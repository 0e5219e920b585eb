// gather and scatter between a root and every rank, each one message per rank
// (gather_linear.cc): at P ranks the root's link carries (P-1) blocks whatever the algorithm,
// and posting all P-1 transfers at once lets UCX overlap them.
#pragma once

#include <chrono>
#include <cstddef>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

struct GatherOptions {
  const void* send = nullptr;  // count elements; on the root, null = already at recv + root*count
  void* recv = nullptr;        // root: size * count elements; ignored elsewhere
  size_t count = 0;            // elements per rank
  DType dtype = DType::kF32;
  int root = 0;
  std::chrono::milliseconds timeout{0};
};

Status gather(Group& group, const GatherOptions& options);

struct ScatterOptions {
  const void* send = nullptr;  // root: size * count elements, block r for rank r
  void* recv = nullptr;        // count elements; on the root, null = leave block root in send
  size_t count = 0;
  DType dtype = DType::kF32;
  int root = 0;
  std::chrono::milliseconds timeout{0};
};

Status scatter(Group& group, const ScatterOptions& options);

}  // namespace wl::comm
