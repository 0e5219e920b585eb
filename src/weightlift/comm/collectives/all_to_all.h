// all_to_all: rank r sends block j of its buffer to rank j and receives rank j's block r;
// all_to_all_v with a count and displacement per peer (what expert parallelism needs to route
// tokens). Every pair exchanges directly (all_to_all_pairwise.cc).
#pragma once

#include <chrono>
#include <cstddef>
#include <span>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

struct AllToAllOptions {
  const void* send = nullptr;  // size * count elements
  void* recv = nullptr;        // size * count elements; must not overlap send
  size_t count = 0;            // elements per peer
  DType dtype = DType::kF32;
  std::chrono::milliseconds timeout{0};
};

Status all_to_all(Group& group, const AllToAllOptions& options);

struct AllToAllVOptions {
  const void* send = nullptr;
  void* recv = nullptr;                  // must not overlap send
  std::span<const size_t> send_counts;   // elements for each peer
  std::span<const size_t> send_offsets;  // elements from `send`
  std::span<const size_t> recv_counts;   // elements from each peer; must match its send_counts
  std::span<const size_t> recv_offsets;  // elements from `recv`
  DType dtype = DType::kF32;
  std::chrono::milliseconds timeout{0};
};

Status all_to_all_v(Group& group, const AllToAllVOptions& options);

}  // namespace wl::comm
