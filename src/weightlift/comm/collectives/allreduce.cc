// allreduce(): validation and the choice of algorithm.
//
// The choice follows the alpha-beta-gamma model of docs/algorithms.md: alpha per message
// step, beta per byte a rank moves through its link, gamma per byte reduced (the constants
// are an AllreduceCostModel, allreduce.h). For n bytes on P ranks (L = floor(log2 P), D the
// trees' depth = L, S tree segments of s bytes, beta' = max(beta, stream_beta)):
//   recursive doubling: L alpha + L n (beta' + gamma)    (+ 2 alpha + 2 n beta' + n gamma)
//   ring:               2(P-1) alpha + 2(P-1)/P n beta' + (P-1)/P n gamma
//   bidirectional ring: 2(P-1) alpha + max(2(P-1)/P n beta, (P-1)/P n stream_beta)
//                       + (P-1)/P n gamma
//   double binary tree: (2D + S - 1)(alpha + s (L beta' + R gamma))
// where L is the segments the busiest rank moves each way in one step of the pipeline (its
// children's and its parent's, over both trees) and R the segments it reduces: 4 and 2 once
// some rank is inner in one tree and below a parent in the other, fewer on a few ranks (2
// ranks: 2 and 1, and the tree costs what the ring does, as the testbed measured).
// Recursive doubling wins while latency dominates; the tree while 2(P-1) ring steps cost more
// than its segments' extra bytes, which on many ranks lasts into the megabytes; the ring for
// the rest.
#include "weightlift/comm/collectives/allreduce.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/host_layout.h"
#include "weightlift/comm/collectives/detail/ring.h"
#include "weightlift/comm/collectives/detail/shm_arena.h"
#include "weightlift/comm/collectives/detail/validate.h"
#include "weightlift/core/check.h"

namespace wl::comm {

namespace {

double stream_beta(const AllreduceCostModel& m) { return std::max(m.beta, m.stream_beta); }

double ring_cost(double n, int p, const AllreduceCostModel& m) {
  const double frac = double(p - 1) / double(p);
  return 2.0 * (p - 1) * m.alpha + 2.0 * frac * n * stream_beta(m) + frac * n * m.gamma;
}

double bidirectional_ring_cost(double n, int p, const AllreduceCostModel& m) {
  const double frac = double(p - 1) / double(p);
  // Both lanes' steps run side by side: the ring's step count, each stream carrying half.
  return 2.0 * (p - 1) * m.alpha + std::max(2.0 * frac * n * m.beta, frac * n * stream_beta(m)) +
         frac * n * m.gamma;
}

double recursive_doubling_cost(double n, int p, const AllreduceCostModel& m) {
  const int levels = int(std::floor(std::log2(double(p))));
  const bool pow2 = (p & (p - 1)) == 0;
  double t = levels * (m.alpha + n * (stream_beta(m) + m.gamma));
  if (!pow2) t += 2.0 * (m.alpha + n * stream_beta(m)) + n * m.gamma;
  return t;
}

// L and R of the tree's formula (see the top) on p ranks: counted on the trees themselves up
// to kCountedTreeRanks, 4 and 2 above (tests/comm/allreduce_test.cc checks every size to 64,
// then sizes 37 apart to 4096).
struct TreeLoad {
  int links = 4;
  int reduces = 2;
};
constexpr int kCountedTreeRanks = 16;

TreeLoad count_tree_load(int p) {
  TreeLoad busiest{0, 0};
  for (int r = 0; r < p; ++r) {
    TreeLoad mine{0, 0};
    for (int tree = 0; tree < 2; ++tree) {
      const detail::TreeLinks t = detail::double_tree_links(p, r, tree);
      const int children = int(t.children[0] >= 0) + int(t.children[1] >= 0);
      mine.links += children + int(t.parent >= 0);
      mine.reduces += children;
    }
    busiest.links = std::max(busiest.links, mine.links);
    busiest.reduces = std::max(busiest.reduces, mine.reduces);
  }
  return busiest;
}

// Counted once for every size up to kCountedTreeRanks: the choice runs at every allreduce.
TreeLoad tree_load(int p) {
  static const std::array<TreeLoad, kCountedTreeRanks + 1> counted = [] {
    std::array<TreeLoad, kCountedTreeRanks + 1> t{};
    for (int q = 2; q <= kCountedTreeRanks; ++q) t[size_t(q)] = count_tree_load(q);
    return t;
  }();
  return p >= 2 && p <= kCountedTreeRanks ? counted[size_t(p)] : TreeLoad{};
}

double tree_cost(double n, int p, const AllreduceCostModel& m) {
  const double seg = double(m.segment_bytes != 0 ? m.segment_bytes : detail::kDefaultSegmentBytes);
  const double half = n / 2.0;
  const double segments = std::max(1.0, std::ceil(half / seg));
  const double s = half / segments;  // the segments of a half are even up to one element
  const double depth = detail::double_tree_depth(p);
  const TreeLoad load = tree_load(p);
  return (2.0 * depth + segments - 1.0) *
         (m.alpha + s * (load.links * stream_beta(m) + load.reduces * m.gamma));
}

}  // namespace

std::string_view allreduce_algorithm_name(AllreduceAlgorithm a) {
  switch (a) {
    case AllreduceAlgorithm::kAuto:
      return "auto";
    case AllreduceAlgorithm::kRing:
      return "ring";
    case AllreduceAlgorithm::kRecursiveDoubling:
      return "recursive_doubling";
    case AllreduceAlgorithm::kSharedMemory:
      return "shm";
    case AllreduceAlgorithm::kTree:
      return "tree";
    case AllreduceAlgorithm::kBidirectionalRing:
      return "bidirectional_ring";
    case AllreduceAlgorithm::kHierarchical:
      return "hierarchical";
  }
  return "unknown";
}

double allreduce_cost_seconds(AllreduceAlgorithm a, size_t bytes, int ranks,
                              const AllreduceCostModel& m) {
  WL_CHECK(ranks >= 1) << "allreduce_cost_seconds: " << ranks << " ranks";
  if (ranks == 1) return 0.0;
  const double n = double(bytes);
  switch (a) {
    case AllreduceAlgorithm::kRing:
      return ring_cost(n, ranks, m);
    case AllreduceAlgorithm::kRecursiveDoubling:
      return recursive_doubling_cost(n, ranks, m);
    case AllreduceAlgorithm::kTree:
      return tree_cost(n, ranks, m);
    case AllreduceAlgorithm::kBidirectionalRing:
      return bidirectional_ring_cost(n, ranks, m);
    case AllreduceAlgorithm::kAuto:
    case AllreduceAlgorithm::kSharedMemory:
    case AllreduceAlgorithm::kHierarchical:
      break;
  }
  WL_CHECK(false) << "allreduce_cost_seconds: no formula for " << allreduce_algorithm_name(a);
  return 0.0;
}

AllreduceAlgorithm choose_allreduce_algorithm(size_t bytes, int ranks,
                                              const AllreduceCostModel& m) {
  if (ranks <= 1) return AllreduceAlgorithm::kRecursiveDoubling;
  AllreduceAlgorithm best = AllreduceAlgorithm::kRecursiveDoubling;
  double best_cost = allreduce_cost_seconds(best, bytes, ranks, m);
  // In order of simplicity: a later one must be strictly cheaper to win.
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::kRing, AllreduceAlgorithm::kTree,
                               AllreduceAlgorithm::kBidirectionalRing}) {
    const double c = allreduce_cost_seconds(a, bytes, ranks, m);
    if (c < best_cost) {
      best = a;
      best_cost = c;
    }
  }
  return best;
}

namespace {

// What allreduce() runs; `arena` is set when that is the shared-memory algorithm, `hosts`
// when it is the hierarchical one.
Result<AllreduceAlgorithm> resolve(Group& g, const AllreduceOptions& o, Deadline deadline,
                                   detail::ShmArena** arena, detail::HostLayout** hosts) {
  AllreduceAlgorithm algo = o.algorithm;
  if (algo == AllreduceAlgorithm::kHierarchical ||
      (algo == AllreduceAlgorithm::kAuto && g.size() > 1)) {
    // The first call on a group learns which ranks share a host (collectively).
    WL_ASSIGN_OR_RETURN(*hosts, detail::host_layout(g, deadline));
    if (algo == AllreduceAlgorithm::kHierarchical || (*hosts)->mixed()) {
      return AllreduceAlgorithm::kHierarchical;
    }
  }
  if (algo != AllreduceAlgorithm::kAuto && algo != AllreduceAlgorithm::kSharedMemory) return algo;
  if (g.size() > 1) {
    // The first call on a group sets up its arena (collectively: every rank gets here).
    WL_ASSIGN_OR_RETURN(detail::ShmArena * a, detail::shm_arena(g, deadline));
    if (a != nullptr) {
      *arena = a;
      return AllreduceAlgorithm::kSharedMemory;
    }
  }
  return choose_allreduce_algorithm(o.count * dtype_size(o.dtype), g.size(), o.cost_model);
}

}  // namespace

Result<AllreduceAlgorithm> resolve_allreduce_algorithm(Group& g, const AllreduceOptions& o) {
  detail::ShmArena* arena = nullptr;
  detail::HostLayout* hosts = nullptr;
  return resolve(g, o, g.deadline(o.timeout), &arena, &hosts);
}

Status allreduce(Group& g, const AllreduceOptions& o) {
  const uint32_t sequence = g.next_sequence();
  WL_RETURN_IF_ERROR(detail::check_reduction(g, "allreduce", o.dtype, o.op));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "allreduce", "recv", o.recv, o.count));
  if (o.count == 0) return ok_status();
  const void* in = o.send != nullptr ? o.send : o.recv;
  if (g.size() == 1) {
    if (in != o.recv) std::memmove(o.recv, in, o.count * dtype_size(o.dtype));
    return ok_status();
  }
  const detail::AllreduceArgs args{.in = in,
                                   .out = o.recv,
                                   .count = o.count,
                                   .dtype = o.dtype,
                                   .op = o.op,
                                   .segment_bytes = o.segment_bytes,
                                   .sequence = sequence};
  const Deadline deadline = g.deadline(o.timeout);
  detail::ShmArena* arena = nullptr;
  detail::HostLayout* hosts = nullptr;
  WL_ASSIGN_OR_RETURN(AllreduceAlgorithm algo, resolve(g, o, deadline, &arena, &hosts));
  switch (algo) {
    case AllreduceAlgorithm::kSharedMemory:
      return detail::allreduce_shm(g, *arena, args, deadline);
    case AllreduceAlgorithm::kHierarchical:
      return detail::allreduce_hierarchical(g, *hosts, args, o.cost_model, deadline);
    case AllreduceAlgorithm::kRing:
      return detail::allreduce_ring(g, args, deadline);
    case AllreduceAlgorithm::kTree:
      return detail::allreduce_tree(g, args, deadline);
    case AllreduceAlgorithm::kBidirectionalRing:
      return detail::allreduce_ring_bidirectional(g, args, deadline);
    case AllreduceAlgorithm::kRecursiveDoubling:
      return detail::allreduce_recursive_doubling(g, args, deadline);
    case AllreduceAlgorithm::kAuto:
      break;
  }
  return invalid_argument("allreduce on " + g.describe() + ": unknown algorithm " +
                          std::to_string(int(algo)));
}

}  // namespace wl::comm
