// allgather: every rank ends with every rank's block, in rank order. allgatherv takes a count
// per rank (uneven blocks, zero allowed). Both run the ring (allgather_ring.cc): P-1 steps,
// each forwarding the block received in the step before, straight into the output.
#pragma once

#include <chrono>
#include <cstddef>
#include <span>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

struct AllgatherOptions {
  const void* send = nullptr;  // count elements; null or == recv + rank * count: in place
  void* recv = nullptr;        // size * count elements
  size_t count = 0;            // elements per rank
  DType dtype = DType::kF32;
  std::chrono::milliseconds timeout{0};
  size_t segment_bytes = 0;
};

Status allgather(Group& group, const AllgatherOptions& options);

struct AllgathervOptions {
  const void* send = nullptr;      // counts[rank] elements; null: already in place in recv
  void* recv = nullptr;            // sum(counts) elements, rank r's block at sum(counts[<r])
  std::span<const size_t> counts;  // one per rank, the same on every rank
  DType dtype = DType::kF32;
  std::chrono::milliseconds timeout{0};
  size_t segment_bytes = 0;
};

Status allgatherv(Group& group, const AllgathervOptions& options);

}  // namespace wl::comm
