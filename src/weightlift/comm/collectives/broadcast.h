// broadcast: the root's buffer to every rank. A pipelined chain (broadcast_chain.cc): the
// buffer flows root -> root+1 -> ... in segments, so that with many segments every link is
// busy at once and the time approaches one buffer's transfer, whatever the rank count.
#pragma once

#include <chrono>
#include <cstddef>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

struct BroadcastOptions {
  void* buffer = nullptr;  // count elements: read on the root, written elsewhere
  size_t count = 0;
  DType dtype = DType::kF32;
  int root = 0;
  std::chrono::milliseconds timeout{0};
  size_t segment_bytes = 0;
};

Status broadcast(Group& group, const BroadcastOptions& options);

}  // namespace wl::comm
