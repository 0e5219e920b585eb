// allreduce: every rank ends with the element-wise reduction of every rank's buffer.
//
//   allreduce(group, {.send = grads, .recv = grads, .count = n, .dtype = DType::kF32,
//                     .op = ReduceOp::kSum, .timeout = 5s});
//
// Six algorithms (docs/algorithms.md has their costs and how one is picked). When every
// rank of the group is on one host with shared memory, kAuto takes the shared-memory
// algorithm at every size (allreduce_shm.cc: loads and stores in mapped scratch, one copy per
// byte). When the group spans several hosts and one of them holds several of its ranks, it
// takes the hierarchical one (allreduce_hierarchical.cc: the ranks of a host sum in shared
// memory, one lane per local rank crosses between hosts, the pieces are gathered back).
// Otherwise (TCP, one rank per host) an alpha-beta-gamma cost model picks among the
// message-passing ones: recursive doubling for small messages (log2 P steps of the whole
// buffer; allreduce_recursive_doubling.cc), the double binary tree for mid-sized messages on
// many ranks (2 log2 P steps, pipelined; allreduce_tree.cc), and the ring for large ones
// (2(P-1) steps of 1/P of it, pipelined; allreduce_ring.cc), or the bidirectional ring
// (allreduce_ring_bidirectional.cc) where one stream cannot fill a rank's link.
#pragma once

#include <chrono>
#include <cstddef>
#include <string_view>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/dtype.h"

namespace wl::comm {

// kSharedMemory where the group cannot map its members' memory falls back to kAuto's choice
// among the message-passing ones.
enum class AllreduceAlgorithm : uint8_t {
  kAuto,
  kRing,
  kRecursiveDoubling,
  kSharedMemory,
  kTree,               // double binary tree, each tree half the buffer (allreduce_tree.cc)
  kBidirectionalRing,  // half the buffer each way round the ring (allreduce_ring_bidirectional.cc)
  kHierarchical,       // inside each host, then between hosts (allreduce_hierarchical.cc)
};

// "ring", "recursive_doubling", "shm", "tree", "bidirectional_ring", "hierarchical", "auto".
std::string_view allreduce_algorithm_name(AllreduceAlgorithm algorithm);

// The alpha-beta-gamma model kAuto chooses with (docs/algorithms.md, "Choosing the allreduce
// algorithm"). The defaults were measured on the machine DESIGN.md describes (2 ranks, UCX over
// shared memory); a caller that has measured its network passes its own.
struct AllreduceCostModel {
  // Seconds per message step: a small tagged message from one rank to the next, software
  // included (UCX posix round: 1-2 us).
  double alpha = 2e-6;
  // Seconds per byte a rank sends through its link while it also receives as much, summed
  // over all its connections (UCX posix: two copies at ~12 GB/s each, so 1/6 ns).
  double beta = 1.0 / 6e9;
  // Seconds per byte one connection carries in one direction when it is alone; 0: beta (one
  // stream fills the link). Larger than beta where a single stream cannot fill the link (one
  // TCP stream on a fast NIC), which is what the bidirectional ring's second stream buys back.
  double stream_beta = 0;
  // Seconds per byte reduced (f32 sum: two reads, one write, ~10 GB/s here).
  double gamma = 1.0 / 10e9;
  // Pipeline segment of the tree (bytes, per tree); 0: the algorithms' default (256 KiB).
  size_t segment_bytes = 0;
};

struct AllreduceOptions {
  const void* send = nullptr;  // count elements; null or == recv: in place
  void* recv = nullptr;        // count elements
  size_t count = 0;            // elements, not bytes
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout{0};  // 0: the group's default
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  // Pipeline segment for the rings and the tree, block of a chunk for shared memory (bytes, at
  // most 128 KiB there); 0: the default. Tests make it small to exercise many segments
  // without big buffers.
  size_t segment_bytes = 0;
  // What kAuto assumes about the network when shared memory is not available.
  AllreduceCostModel cost_model{};
};

Status allreduce(Group& group, const AllreduceOptions& options);

// The algorithm allreduce() runs for `options` on `group` (count and dtype give the size):
// for kAuto, kHierarchical where the group spans several hosts and one holds several of its
// ranks; for kAuto or kSharedMemory, kSharedMemory where the group maps its members' memory;
// else the one asked for or the model's pick. Collective on a group's first call (it learns
// which ranks share a host and sets up the shared-memory arena, as allreduce() would), cheap
// after.
Result<AllreduceAlgorithm> resolve_allreduce_algorithm(Group& group,
                                                       const AllreduceOptions& options);

// Which message-passing algorithm kAuto picks for `bytes` on `ranks` ranks when shared memory
// is not available: the cheapest under `model` (exposed so the benchmark can print it and the
// tests can pin it). Ties go to the simpler algorithm: recursive doubling, ring, tree,
// bidirectional ring.
AllreduceAlgorithm choose_allreduce_algorithm(size_t bytes, int ranks,
                                              const AllreduceCostModel& model = {});

// The model's time in seconds for one message-passing `algorithm` (not kAuto, kSharedMemory
// or kHierarchical: those have no formula here) on `bytes` over `ranks` ranks.
double allreduce_cost_seconds(AllreduceAlgorithm algorithm, size_t bytes, int ranks,
                              const AllreduceCostModel& model = {});

}  // namespace wl::comm
