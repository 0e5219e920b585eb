// Process groups: split by color and key, tags that keep concurrent collectives on different
// groups apart, and the timeout every operation has.
#include "weightlift/comm/group.h"

#include <gtest/gtest.h>

#include <barrier>
#include <thread>
#include <vector>

#include "exact_data.h"
#include "rank_threads.h"
#include "weightlift/comm/collectives.h"

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
// Here rank 1 runs the barrier's rounds by hand and dawdles 300 ms before its last one, so
// ranks 0 and 2 pass and leave while rank 3 still waits for rank 1: their leaving must not
// fail rank 3 (over TCP it sees their connections close).
TEST(Group, ABarrierIgnoresRanksThatPassedItAndLeft) {
  auto store = std::make_shared<MemoryStore>();
  testing::run_ranks(4, [&](int r) {
    auto g = Group::connect({.store = store, .rank = r, .size = 4, .timeout = 10s});
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    Group& group = **g;
    if (r != 1) {
      Status s = barrier(group);
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
      return;  // ranks 0 and 2 leave here, closing their connections
    }
    // The dissemination barrier's rounds for rank 1 of 4: round 0 from 0 / to 2, round 1
    // from 3 / to 3.
    const uint32_t sequence = group.next_sequence();
    const Deadline deadline = group.deadline(10s);
    Request round0[2] = {group.irecv(0, sequence, 0, nullptr, 0),
                         group.isend(2, sequence, 0, nullptr, 0)};
    ASSERT_TRUE(group.wait_all(round0, deadline).ok());
    std::this_thread::sleep_for(300ms);
    Request round1[2] = {group.irecv(3, sequence, 1, nullptr, 0),
                         group.isend(3, sequence, 1, nullptr, 0)};
    Status s = group.wait_all_watching(round1, std::vector<int>{3}, deadline);
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
}

// Two worlds over one shared worker (a fleet re-forming its group between updates): the second
// world of the same ranks gets its own group id, so messages of one never match the other's.
TEST(Group, WorldsSharingAWorkerDoNotCross) {
  auto store = std::make_shared<MemoryStore>();
  testing::run_ranks(3, [&](int r) {
    auto w = Worker::create({.name = "shared " + std::to_string(r)});
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    std::shared_ptr<Worker> worker = std::move(*w);
    auto connect = [&](const std::string& prefix) {
      return Group::connect({.store = store,
                             .rank = r,
                             .size = 3,
                             .timeout = 20s,
                             .prefix = prefix,
                             .transport = worker,
                             .ids_key = "ids"});
    };
    auto a = connect("a");
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    auto b = connect("b");
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_NE((*a)->id(), (*b)->id());
    EXPECT_EQ(&(*a)->worker(), &(*b)->worker());
    constexpr size_t kCount = 777;
    std::vector<int32_t> xa(kCount, r + 1), xb(kCount, (r + 1) * 1000);
    auto op_a = [&] {
      return allreduce(
          **a, {.recv = xa.data(), .count = kCount, .dtype = DType::kI32, .segment_bytes = 128});
    };
    auto op_b = [&] {
      return allreduce(
          **b, {.recv = xb.data(), .count = kCount, .dtype = DType::kI32, .segment_bytes = 128});
    };
    // Every rank runs a then b (two worlds are ordered like any two collectives), but the
    // ranks other than 0 dawdle after a: rank 0's b messages reach them while they are still
    // in (or just out of) a, on the same worker, with the same sequence numbers.
    Status first = op_a();
    if (r != 0) std::this_thread::sleep_for(5ms);
    Status second = op_b();
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
