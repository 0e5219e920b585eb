// The allreduce algorithms behind allreduce() (allreduce.cc picks one). Arguments are
// already validated; `in` may equal `out` (in place), `count` > 0.
#pragma once

#include <cstddef>

#include "weightlift/comm/collectives/allreduce.h"

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

// One call of a segmented algorithm (the tree, the bidirectional ring): what every step reads,
// the buffers as bytes with their element and segment sizes.
struct SegmentedCall {
  SegmentedCall(Group& g, const AllreduceArgs& a, Deadline deadline);
  Group& g_;
  const AllreduceArgs& a_;
  const Deadline deadline_;
  const int P_;       // ranks
  const size_t es_;   // bytes per element
  const size_t seg_;  // elements per segment
  const std::byte* in_;
  std::byte* out_;
};

Status allreduce_ring(Group& group, const AllreduceArgs& args, Deadline deadline);
Status allreduce_recursive_doubling(Group& group, const AllreduceArgs& args, Deadline deadline);
Status allreduce_tree(Group& group, const AllreduceArgs& args, Deadline deadline);
Status allreduce_ring_bidirectional(Group& group, const AllreduceArgs& args, Deadline deadline);
// A rank's place in one of the two trees of the double binary tree (allreduce_tree.cc).
// Group ranks; -1: none (the root has no parent, a leaf no children).
struct TreeLinks {
  int parent = -1;
  int children[2] = {-1, -1};
};
// Tree 0 or 1 over `ranks` ranks. Every rank that is an inner node of one tree is a leaf of
// the other (for odd `ranks`, all but one).
TreeLinks double_tree_links(int ranks, int rank, int tree);
// Edges from the root to the deepest leaf, the same for both trees: floor(log2 ranks).
int double_tree_depth(int ranks);

class ShmArena;
Status allreduce_shm(Group& group, ShmArena& arena, const AllreduceArgs& args, Deadline deadline);
// `model` picks the algorithm between hosts (allreduce_hierarchical.cc).
class HostLayout;
Status allreduce_hierarchical(Group& group, HostLayout& layout, const AllreduceArgs& args,
                              const AllreduceCostModel& model, Deadline deadline);

}  // namespace wl::comm::detail
