// allreduce with ranks as threads: every dtype and op, counts 0, 1, odd and not divisible by
// the world size, in place and out of place, unaligned buffers with guard bytes, every
// algorithm (the rings and the tree with tiny segments so that every block has many and the
// tree's window of receives wraps), world sizes 1-8. Then the trees' shape and the selector.
#include "weightlift/comm/collectives/allreduce.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "exact_data.h"
#include "rank_threads.h"
#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/shm_arena.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;
using testing::GuardedBuffer;

constexpr AllreduceAlgorithm kAlgorithms[] = {
    AllreduceAlgorithm::kRing, AllreduceAlgorithm::kRecursiveDoubling,
    AllreduceAlgorithm::kSharedMemory, AllreduceAlgorithm::kTree,
    AllreduceAlgorithm::kBidirectionalRing};

// (world size, algorithm)
class AllreduceTest : public ::testing::TestWithParam<std::tuple<int, AllreduceAlgorithm>> {};
// World size; kAuto and the shared-memory path's own edges.
class AllreduceAutoTest : public ::testing::TestWithParam<int> {};

// One allreduce on this rank, checked against the closed form.
void check_allreduce(Group& g, DType dtype, ReduceOp op, size_t count, bool in_place,
                     AllreduceAlgorithm algo, size_t segment_bytes) {
  const int P = g.size(), r = g.rank();
  GuardedBuffer send(dtype, count), recv(dtype, count);
  GuardedBuffer& input = in_place ? recv : send;
  for (size_t i = 0; i < count; ++i)
    testing::put(dtype, input.data(), i, testing::value(op, P, r, i));
  Status s = allreduce(g, {.send = in_place ? nullptr : send.data(),
                           .recv = recv.data(),
                           .count = count,
                           .dtype = dtype,
                           .op = op,
                           .algorithm = algo,
                           .segment_bytes = segment_bytes});
  ASSERT_TRUE(s.ok()) << s.to_string() << "\n(" << dtype_name(dtype) << " " << reduce_op_name(op)
                      << ", count " << count << (in_place ? " in place" : "") << ", algorithm "
                      << allreduce_algorithm_name(algo) << ")";
  for (size_t i = 0; i < count; ++i) {
    ASSERT_EQ(testing::get(dtype, recv.data(), i), testing::expected(op, P, i))
        << "rank " << r << " of " << P << ", " << dtype_name(dtype) << " " << reduce_op_name(op)
        << ", count " << count << (in_place ? " in place" : "") << ", algorithm "
        << allreduce_algorithm_name(algo) << ", element " << i;
  }
  EXPECT_TRUE(send.guards_intact() && recv.guards_intact());
  if (!in_place) {  // the input is left as it was
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(testing::get(dtype, send.data(), i), testing::value(op, P, r, i));
    }
  }
}

TEST_P(AllreduceTest, EveryTypeOpAndCount) {
  const auto [P, algo] = GetParam();
  testing::run_world(P, [&](Group& g) {
    for (DType dtype : testing::kReducibleTypes) {
      for (ReduceOp op : testing::kOps) {
        for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(4 * 5 + 3), size_t(97)}) {
          for (bool in_place : {false, true}) {
            // 6-byte segments: blocks of a few elements split into several segments (rings),
            // halves of up to 49 one-element segments (tree: more than its window of 16),
            // chunks of a few elements (shared memory), so slots wrap many times.
            check_allreduce(g, dtype, op, count, in_place, algo, 6);
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  });
}

TEST_P(AllreduceTest, LargeBuffersWithDefaultSegments) {
  const auto [P, algo] = GetParam();
  testing::run_world(P, [&](Group& g) {
    for (size_t count : {size_t(1) << 10, (size_t(1) << 20) + 3}) {
      check_allreduce(g, DType::kF32, ReduceOp::kSum, count, false, algo, 0);
      if (::testing::Test::HasFatalFailure()) return;
      check_allreduce(g, DType::kBF16, ReduceOp::kMax, count, true, algo, 0);
      if (::testing::Test::HasFatalFailure()) return;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AllreduceTest,
                         ::testing::Combine(::testing::Range(1, 9),
                                            ::testing::ValuesIn(kAlgorithms)),
                         [](const ::testing::TestParamInfo<AllreduceTest::ParamType>& info) {
                           return std::to_string(std::get<0>(info.param)) + "_ranks_" +
                                  std::string(allreduce_algorithm_name(std::get<1>(info.param)));
                         });

TEST_P(AllreduceAutoTest, LargeBuffersWithDefaultSegments) {
  const int P = GetParam();
  testing::run_world(P, [&](Group& g) {
    for (size_t count : {size_t(1) << 10, (size_t(1) << 20) + 3}) {
      check_allreduce(g, DType::kF32, ReduceOp::kSum, count, false, AllreduceAlgorithm::kAuto, 0);
    }
  });
}

TEST_P(AllreduceAutoTest, OutputsPastTheStreamingThreshold) {
  // 8 MiB and more are written with non-temporal stores on the shared-memory path, and the
  // slots may be too (always one chunk in 16, when the rank tries that way), the reduction
  // writing its result block and its output at once (allreduce_shm.cc): the unaligned head
  // and tail, the fences and the partial sums of three ranks and more must still leave every
  // element right, in place and out of place, with the average divided before either store.
  const int P = GetParam();
  testing::run_world(P, [&](Group& g) {
    const size_t count = (size_t(2) << 20) + 3;
    check_allreduce(g, DType::kF32, ReduceOp::kSum, count, false, AllreduceAlgorithm::kAuto, 0);
    check_allreduce(g, DType::kI32, ReduceOp::kMax, count, true, AllreduceAlgorithm::kAuto, 0);
    check_allreduce(g, DType::kF32, ReduceOp::kAvg, count, false, AllreduceAlgorithm::kAuto, 0);
    // A small one after, on slots last written by streaming stores.
    check_allreduce(g, DType::kF32, ReduceOp::kSum, 1 << 16, false, AllreduceAlgorithm::kAuto, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AllreduceAutoTest, ::testing::Values(1, 2, 3, 4));

// The shared-memory path's choice of how a rank writes its slots: ordinary stores until
// streaming measures clearly cheaper, one chunk in kExploreEvery trying the other way, and back
// when the placement changes again.
TEST(SlotWriteChooser, KeepsOrdinaryStoresUnlessStreamingIsClearlyCheaperAndKeepsLooking) {
  using detail::SlotWriteChooser;
  SlotWriteChooser c;
  const uint64_t explore = SlotWriteChooser::kExploreEvery - 1;
  EXPECT_FALSE(c.stream(0));
  EXPECT_TRUE(c.stream(explore));  // nothing measured yet: try streaming now and then
  c.record(false, 1.0);
  c.record(true, 0.8);  // cheaper, but within the margin
  EXPECT_FALSE(c.stream(1));
  EXPECT_TRUE(c.stream(explore));
  for (int i = 0; i < 10; ++i) c.record(false, 5.0);  // the cores went apart
  EXPECT_TRUE(c.stream(1));
  EXPECT_FALSE(c.stream(explore + SlotWriteChooser::kExploreEvery));  // still tries the old way
  for (int i = 0; i < 20; ++i) c.record(false, 0.7);                  // and back together
  EXPECT_FALSE(c.stream(1));
}

// Both trees span every rank once, parent and child links agree, the depth is what the cost
// model assumes, and no rank is an inner node of both trees.
TEST(DoubleTree, TwoSpanningTreesOfLogDepthWithDisjointInnerNodes) {
  for (int P = 1; P <= 1024; ++P) {
    std::vector<int> inner(size_t(P), 0), leaf(size_t(P), 0);
    for (int tree = 0; tree < 2; ++tree) {
      int roots = 0, deepest = 0;
      for (int r = 0; r < P; ++r) {
        const detail::TreeLinks t = detail::double_tree_links(P, r, tree);
        if (t.parent < 0) {
          ++roots;
        } else {
          ASSERT_LT(t.parent, P) << "P " << P << " tree " << tree << " rank " << r;
          const detail::TreeLinks up = detail::double_tree_links(P, t.parent, tree);
          ASSERT_TRUE(up.children[0] == r || up.children[1] == r)
              << "P " << P << " tree " << tree << ": rank " << r << "'s parent " << t.parent
              << " does not list it as a child";
        }
        int children = 0;
        for (int c : t.children) {
          if (c < 0) continue;
          ++children;
          ASSERT_EQ(detail::double_tree_links(P, c, tree).parent, r)
              << "P " << P << " tree " << tree << " rank " << r << " child " << c;
        }
        (children > 0 ? inner : leaf)[size_t(r)]++;
        // The walk to the root ends (no cycle) within the depth the model uses.
        int depth = 0;
        for (int at = r; detail::double_tree_links(P, at, tree).parent >= 0; ++depth) {
          at = detail::double_tree_links(P, at, tree).parent;
          ASSERT_LE(depth, P) << "P " << P << " tree " << tree << ": cycle above rank " << r;
        }
        deepest = std::max(deepest, depth);
      }
      ASSERT_EQ(roots, 1) << "P " << P << " tree " << tree;
      ASSERT_EQ(deepest, detail::double_tree_depth(P)) << "P " << P << " tree " << tree;
    }
    for (int r = 0; r < P; ++r) {
      ASSERT_LE(inner[size_t(r)], 1) << "P " << P << ": rank " << r << " inner in both trees";
      // Odd P: rank 0 is the one rank left a leaf in both.
      if (P > 1 && (P % 2 == 0 || r != 0)) {
        ASSERT_EQ(inner[size_t(r)], 1) << "P " << P << ": rank " << r << " a leaf in both";
      }
    }
  }
}

// The tree's cost counts the busiest rank's segments per step (allreduce.cc): on 2 ranks, one
// each way per tree, so its bytes are the ring's and only its extra steps cost more; from 17
// ranks on the formula assumes 4 each way and 2 reduced, which every size to 64 has, and the
// sizes 37 apart from there to 4096.
TEST(AllreduceChoice, TheTreesLoadIsCountedOnTheTrees) {
  for (int P = 2; P <= 4096; P += (P < 64 ? 1 : 37)) {
    int links = 0, reduces = 0;
    for (int r = 0; r < P; ++r) {
      int l = 0, c = 0;
      for (int tree = 0; tree < 2; ++tree) {
        const detail::TreeLinks t = detail::double_tree_links(P, r, tree);
        const int children = int(t.children[0] >= 0) + int(t.children[1] >= 0);
        l += children + int(t.parent >= 0);
        c += children;
      }
      links = std::max(links, l);
      reduces = std::max(reduces, c);
    }
    if (P > 16) {
      ASSERT_EQ(links, 4) << "P " << P;
      ASSERT_EQ(reduces, 2) << "P " << P;
    }
  }
  // 2 ranks, 64 MiB: the tree moves what the ring moves, in more steps.
  const AllreduceCostModel m{.alpha = 1e-5, .beta = 1e-9, .gamma = 0};
  const size_t n = size_t(64) << 20;
  const double ring = allreduce_cost_seconds(AllreduceAlgorithm::kRing, n, 2, m);
  const double tree = allreduce_cost_seconds(AllreduceAlgorithm::kTree, n, 2, m);
  EXPECT_GT(tree, ring);
  EXPECT_LT(tree, ring * 1.05);  // a segment of fill, and an alpha a step
}

TEST(AllreduceChoice, SmallBuffersTakeALatencyAlgorithmLargeOnesTheRing) {
  for (int p : {2, 4, 8}) {
    EXPECT_EQ(choose_allreduce_algorithm(8, p), AllreduceAlgorithm::kRecursiveDoubling) << p;
  }
  // Three ranks: the tree's two steps beat recursive doubling's three (fold, swap, unfold).
  EXPECT_EQ(choose_allreduce_algorithm(8, 3), AllreduceAlgorithm::kTree);
  for (int p : {2, 3, 4, 8}) {
    EXPECT_EQ(choose_allreduce_algorithm(64 << 20, p), AllreduceAlgorithm::kRing) << p;
  }
}

TEST(AllreduceChoice, ManyRanksAcrossHostsTakeTheTreeForMidSizes) {
  // The inter-host numbers `bench collectives --model` defaults to: 5 us, 12.5 GB/s.
  const AllreduceCostModel hosts{.alpha = 5e-6, .beta = 1 / 12.5e9};
  EXPECT_EQ(choose_allreduce_algorithm(8, 1024, hosts), AllreduceAlgorithm::kRecursiveDoubling);
  EXPECT_EQ(choose_allreduce_algorithm(16 << 20, 1024, hosts), AllreduceAlgorithm::kTree);
  EXPECT_EQ(choose_allreduce_algorithm(size_t(1) << 30, 8, hosts), AllreduceAlgorithm::kRing);
  // A stream that carries half the link: the second direction of the ring pays.
  AllreduceCostModel slow_stream = hosts;
  slow_stream.stream_beta = 2 * hosts.beta;
  EXPECT_EQ(choose_allreduce_algorithm(size_t(1) << 30, 8, slow_stream),
            AllreduceAlgorithm::kBidirectionalRing);
}

TEST(AllreduceChoice, PicksTheCheapestUnderTheModel) {
  const AllreduceCostModel models[] = {{},
                                       {.alpha = 5e-6, .beta = 1 / 12.5e9},
                                       {.alpha = 1e-6, .beta = 1e-10, .stream_beta = 3e-10}};
  for (const AllreduceCostModel& m : models) {
    for (int p : {2, 3, 5, 8, 13, 64, 1000}) {
      for (size_t n = 8; n <= (size_t(1) << 30); n *= 4) {
        const AllreduceAlgorithm pick = choose_allreduce_algorithm(n, p, m);
        const double cost = allreduce_cost_seconds(pick, n, p, m);
        for (AllreduceAlgorithm a :
             {AllreduceAlgorithm::kRing, AllreduceAlgorithm::kRecursiveDoubling,
              AllreduceAlgorithm::kTree, AllreduceAlgorithm::kBidirectionalRing}) {
          EXPECT_LE(cost, allreduce_cost_seconds(a, n, p, m))
              << "P " << p << ", " << n << " bytes: picked " << allreduce_algorithm_name(pick)
              << ", " << allreduce_algorithm_name(a) << " is cheaper";
        }
      }
    }
  }
}

// ---- the hierarchical allreduce: ranks as threads that count as being on several hosts ----

struct HostCase {
  const char* name;
  std::vector<uint64_t> hosts;  // rank r's host
};
// Even and uneven hosts (the fewest ranks on a host set the lanes), ranks of a host not next
// to each other in the group, and hosts of one rank beside hosts of several.
const HostCase kMixedHosts[] = {
    {"2 hosts x 2", {1, 1, 2, 2}},
    {"3 + 2", {1, 1, 1, 2, 2}},
    {"1 + 3", {7, 9, 9, 9}},
    {"interleaved 2 x 3", {1, 2, 1, 2, 1, 2}},
    {"4 hosts x 2", {1, 1, 2, 2, 3, 3, 4, 4}},
};

TEST(HierarchicalAllreduce, AutoTakesItOnMixedHostsAndEveryTypeOpAndCountIsRight) {
  for (const HostCase& c : kMixedHosts) {
    SCOPED_TRACE(c.name);
    testing::run_world_on_hosts(c.hosts, [&](Group& g) {
      float x = 0;
      auto picked = resolve_allreduce_algorithm(g, {.recv = &x, .count = 1});
      ASSERT_TRUE(picked.ok()) << picked.status().to_string();
      EXPECT_EQ(*picked, AllreduceAlgorithm::kHierarchical);
      for (DType dtype : testing::kReducibleTypes) {
        for (ReduceOp op : testing::kOps) {
          // Counts below the lanes (pieces of nothing), odd and not divisible by them.
          for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(4 * 5 + 3), size_t(97)}) {
            for (bool in_place : {false, true}) {
              check_allreduce(g, dtype, op, count, in_place, AllreduceAlgorithm::kAuto, 6);
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    });
  }
}

TEST(HierarchicalAllreduce, LargeBuffersWithDefaultSegments) {
  for (const HostCase& c : {kMixedHosts[0], kMixedHosts[1]}) {
    SCOPED_TRACE(c.name);
    testing::run_world_on_hosts(c.hosts, [&](Group& g) {
      for (size_t count : {size_t(1) << 16, (size_t(1) << 20) + 3}) {
        check_allreduce(g, DType::kF32, ReduceOp::kSum, count, false, AllreduceAlgorithm::kAuto, 0);
        if (::testing::Test::HasFatalFailure()) return;
        check_allreduce(g, DType::kBF16, ReduceOp::kMax, count, true, AllreduceAlgorithm::kAuto, 0);
        if (::testing::Test::HasFatalFailure()) return;
      }
    });
  }
}

// One host, or one rank per host: kAuto keeps its choice (shared memory; the model's pick),
// and asking for the hierarchical algorithm there still gives the right result (a single
// host's allreduce, or one lane across every host).
TEST(HierarchicalAllreduce, OneHostOrOneRankPerHostKeepTheFlatChoice) {
  const std::vector<uint64_t> layouts[] = {{5, 5, 5}, {1, 2, 3, 4}};
  for (const std::vector<uint64_t>& hosts : layouts) {
    testing::run_world_on_hosts(hosts, [&](Group& g) {
      float x = 0;
      auto picked = resolve_allreduce_algorithm(g, {.recv = &x, .count = 1000});
      ASSERT_TRUE(picked.ok()) << picked.status().to_string();
      EXPECT_NE(*picked, AllreduceAlgorithm::kHierarchical) << "hosts " << hosts.size();
      check_allreduce(g, DType::kF32, ReduceOp::kSum, 1000, false,
                      AllreduceAlgorithm::kHierarchical, 6);
      check_allreduce(g, DType::kI64, ReduceOp::kMax, 97, true, AllreduceAlgorithm::kHierarchical,
                      0);
    });
  }
}

TEST(Allreduce, RejectsFp8AndNullBuffers) {
  testing::run_world(1, [](Group& g) {
    uint8_t x[4] = {};
    EXPECT_EQ(allreduce(g, {.recv = x, .count = 4, .dtype = DType::kF8E4M3}).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(allreduce(g, {.recv = nullptr, .count = 4}).code(), StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace wl::comm
