// Process groups: split by color and key, tags that keep concurrent collectives on different
// groups apart, and the timeout every operation has.
#include "weightlift/comm/group/group.h"

#include <gtest/gtest.h>

#include <barrier>
#include <vector>

#include "exact_data.h"
#include "rank_threads.h"
#include "weightlift/comm/collectives/collectives.h"
#include "weightlift/comm/transport/fault_transport.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;

TEST(Group, SplitByColorOrdersByKey) {
  testing::run_world(4, [](Group& world) {
    const int r = world.rank();
    // Colors {0, 1, 0, 1}; keys reverse the order within each color.
    auto sub = world.split({.color = r % 2, .key = -r});
    ASSERT_TRUE(sub.ok()) << sub.status().to_string();
    Group& g = **sub;
    EXPECT_EQ(g.size(), 2);
    EXPECT_EQ(g.rank(), r < 2 ? 1 : 0);
    EXPECT_EQ(g.world_rank(g.rank()), r);
    EXPECT_NE(g.id(), world.id());
    // Ranks that opt out get no group; the others still split fine.
    auto only_low = world.split({.color = r < 3 ? 0 : kNoColor});
    ASSERT_TRUE(only_low.ok()) << only_low.status().to_string();
    if (r == 3) {
      EXPECT_EQ(*only_low, nullptr);
    } else {
      ASSERT_NE(*only_low, nullptr);
      EXPECT_EQ((*only_low)->size(), 3);
      EXPECT_EQ((*only_low)->rank(), r);
      EXPECT_NE((*only_low)->id(), g.id());
    }
  });
}

TEST(Group, CollectivesOnDifferentGroupsDoNotCross) {
  // World of 4 split into {0,2} and {1,3}. The even group runs its allreduce before the world
  // one, the odd group after, so world messages from ranks 1 and 3 reach ranks 0 and 2 while
  // these are inside their sub-group's allreduce, and the two sub-groups run at the same time.
  // Same sizes, same sequence numbers: only the group id in the tag keeps them apart.
  testing::run_world(4, [](Group& world) {
    const int r = world.rank();
    auto sub = world.split({.color = r % 2, .key = r});
    ASSERT_TRUE(sub.ok()) << sub.status().to_string();
    Group& g = **sub;
    constexpr size_t kCount = 1000;
    for (int round = 0; round < 5; ++round) {
      std::vector<int32_t> world_buf(kCount, r + 1), sub_buf(kCount, (r + 1) * 100);
      auto run_world_op = [&] {
        return allreduce(world, {.recv = world_buf.data(),
                                 .count = kCount,
                                 .dtype = DType::kI32,
                                 .segment_bytes = 256});
      };
      auto run_sub_op = [&] {
        return allreduce(
            g,
            {.recv = sub_buf.data(), .count = kCount, .dtype = DType::kI32, .segment_bytes = 256});
      };
      if (r % 2 == 0) {
        ASSERT_TRUE(run_sub_op().ok());
        ASSERT_TRUE(run_world_op().ok());
      } else {
        ASSERT_TRUE(run_world_op().ok());
        ASSERT_TRUE(run_sub_op().ok());
      }
      const int sub_sum = r % 2 == 0 ? (1 + 3) * 100 : (2 + 4) * 100;
      for (size_t i = 0; i < kCount; ++i) {
        ASSERT_EQ(world_buf[i], 1 + 2 + 3 + 4);
        ASSERT_EQ(sub_buf[i], sub_sum);
      }
    }
  });
}

TEST(Group, ACollectiveWithAMissingRankTimesOut) {
  // Rank 1 never joins the allreduce; rank 0 must come back with kDeadlineExceeded naming
  // the peer, within a bounded time, instead of hanging.
  auto store = std::make_shared<MemoryStore>();
  std::barrier done(2);
  testing::run_ranks(2, [&](int rank) {
    auto g = Group::connect({.store = store, .rank = rank, .size = 2, .timeout = 10s});
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    if (rank == 0) {
      std::vector<float> x(64, 1.0f);
      const auto start = Clock::now();
      Status s = allreduce(**g, {.recv = x.data(), .count = x.size(), .timeout = 300ms});
      EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
      EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
      EXPECT_LT(Clock::now() - start, 5s);
    }
    done.arrive_and_wait();
  });
}

TEST(Group, ConnectTimesOutWhenARankNeverComes) {
  auto store = std::make_shared<MemoryStore>();
  auto g = Group::connect({.store = store, .rank = 0, .size = 2, .timeout = 200ms});
  EXPECT_EQ(g.status().code(), StatusCode::kDeadlineExceeded) << g.status().to_string();
}

// Jobs end with a barrier, and a rank that has passed it tears down its connections at once.
// Here rank 1 runs the barrier's rounds by hand and starts its last one only once ranks 0 and
// 2 have passed the barrier and closed their connections (they say so in the store), while
// rank 3 still waits for rank 1: their leaving must not fail rank 3 (over TCP it sees their
// connections close).
TEST(Group, ABarrierIgnoresRanksThatPassedItAndLeft) {
  auto store = std::make_shared<MemoryStore>();
  testing::run_ranks(4, [&](int r) {
    auto g = Group::connect({.store = store, .rank = r, .size = 4, .timeout = 10s});
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    if (r != 1) {
      Status s = barrier(**g);
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
      if (r == 3) return;
      g->reset();  // ranks 0 and 2 leave: the group and its worker go, closing connections
      EXPECT_TRUE(store->set("left/" + std::to_string(r), to_bytes("gone")).ok());
      return;
    }
    Group& group = **g;
    // The dissemination barrier's rounds for rank 1 of 4: round 0 from 0 / to 2, round 1
    // from 3 / to 3.
    const uint32_t sequence = group.next_sequence();
    const Deadline deadline = group.deadline(10s);
    Request round0[2] = {group.irecv(0, sequence, 0, nullptr, 0),
                         group.isend(2, sequence, 0, nullptr, 0)};
    ASSERT_TRUE(group.wait_all(round0, deadline).ok());
    // Waiting, rank 1 keeps progressing its worker, as a rank between operations does: over
    // TCP the leavers' graceful close needs an answer from it.
    for (const char* left : {"left/0", "left/2"}) {
      Result<Bytes> v = store->get(left, 0ms);
      while (!v.ok() && Clock::now() < deadline) {
        group.worker().progress();
        v = store->get(left, 1ms);
      }
      ASSERT_TRUE(v.ok()) << v.status().to_string();
    }
    Request round1[2] = {group.irecv(3, sequence, 1, nullptr, 0),
                         group.isend(3, sequence, 1, nullptr, 0)};
    Status s = group.wait_all_watching(round1, std::vector<int>{3}, deadline);
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
}

// Two worlds over one shared transport (a fleet re-forming its group between updates): the
// second world of the same ranks gets its own group id, so messages of one never match the
// other's. Every rank runs an allreduce on a, then on b: the same sequence number and steps.
// Recursive doubling on 3 ranks: rank 0 hands its buffer to rank 1, ranks 1 and 2 swap at
// step 1, rank 1 hands the result back. Rank 1's step-1 message of a is held (fault
// transport) until it has sent its step-1 message of b, so while rank 2 is still inside a,
// waiting for exactly that (sender, sequence, step), b's message is sent to it first (and on
// one host, through the one shared-memory queue rank 2 reads, arrives first): only the group
// id in the tag keeps it from completing a with b's numbers.
TEST(Group, WorldsSharingATransportDoNotCross) {
  auto store = std::make_shared<MemoryStore>();
  testing::run_ranks(3, [&](int r) {
    auto t = FaultTransport::create({.name = "shared " + std::to_string(r)});
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    std::shared_ptr<FaultTransport> faults = *t;
    auto connect = [&](const std::string& prefix) {
      return Group::connect({.store = store,
                             .rank = r,
                             .size = 3,
                             .timeout = 20s,
                             .prefix = prefix,
                             .transport = faults,
                             .ids_key = "ids"});
    };
    auto a = connect("a");
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    auto b = connect("b");
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_NE((*a)->id(), (*b)->id());
    EXPECT_EQ(&(*a)->worker(), &(*b)->worker());
    if (r == 1) {
      // Each world connected its own endpoints: the held send goes on a's, its release is the
      // first send on b's.
      faults->hold({.op = TransportOp::kSend, .peer = (*a)->worker_peer(2)},
                   {.op = TransportOp::kSend, .peer = (*b)->worker_peer(2)});
    }
    constexpr size_t kCount = 777;
    std::vector<int32_t> xa(kCount, r + 1), xb(kCount, (r + 1) * 1000);
    auto op = [&](Group& g, std::vector<int32_t>& x) {
      return allreduce(g, {.recv = x.data(),
                           .count = kCount,
                           .dtype = DType::kI32,
                           .algorithm = AllreduceAlgorithm::kRecursiveDoubling});
    };
    Status first = op(**a, xa);
    Status second = op(**b, xb);
    ASSERT_TRUE(first.ok()) << first.to_string();
    ASSERT_TRUE(second.ok()) << second.to_string();
    EXPECT_EQ(xa, std::vector<int32_t>(kCount, 6));
    EXPECT_EQ(xb, std::vector<int32_t>(kCount, 6000));
    EXPECT_TRUE(barrier(**a).ok());
  });
  // Sharing needs the common id counter.
  auto w = Worker::create({});
  ASSERT_TRUE(w.ok());
  auto g = Group::connect(
      {.store = store, .rank = 0, .size = 1, .transport = std::shared_ptr<Worker>(std::move(*w))});
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << g.status().to_string();
}

}  // namespace
}  // namespace wl::comm
