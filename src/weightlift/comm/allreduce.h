// allreduce: every rank ends with the element-wise reduction of every rank's buffer.
//
//   allreduce(group, {.send = grads, .recv = grads, .count = n, .dtype = DType::kF32,
//                     .op = ReduceOp::kSum, .timeout = 5s});
//
// Three algorithms (docs/algorithms.md has their costs and how one is picked). When every
// rank of the group is on one host with shared memory, kAuto takes the shared-memory
// algorithm at every size (allreduce_shm.cc: loads and stores in mapped scratch, one copy per
// byte). Otherwise (TCP, several hosts) the cost model picks between recursive doubling for
// small messages (log2 P steps of the whole buffer; allreduce_recursive_doubling.cc) and the
// ring for large ones (2(P-1) steps of 1/P of it, pipelined in segments; allreduce_ring.cc).
#pragma once

#include <chrono>
#include <cstddef>

#include "weightlift/comm/group.h"
#include "weightlift/comm/reduce_op.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

// kSharedMemory where the group cannot map its members' memory falls back to kAuto's choice
// between the other two.
enum class AllreduceAlgorithm : uint8_t { kAuto, kRing, kRecursiveDoubling, kSharedMemory };

struct AllreduceOptions {
  const void* send = nullptr;  // count elements; null or == recv: in place
  void* recv = nullptr;        // count elements
  size_t count = 0;            // elements, not bytes
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout{0};  // 0: the group's default
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  // Pipeline segment for the ring, block of a chunk for shared memory (bytes, at most 128 KiB
  // there); 0: the default. Tests make it small to exercise many segments without big buffers.
  size_t segment_bytes = 0;
};

Status allreduce(Group& group, const AllreduceOptions& options);

// Which message-passing algorithm kAuto picks for `bytes` on `ranks` ranks when shared memory
// is not available (the cost model; exposed so the benchmark can print it and the tests can
// pin it).
AllreduceAlgorithm choose_allreduce_algorithm(size_t bytes, int ranks);

}  // namespace wl::comm
