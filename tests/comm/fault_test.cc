// Faults through the transport interface (fault_transport.h), under real Groups with ranks as
// threads: the Nth put fails and only it; a dropped peer fails every collective at once,
// naming it; a link dropped at a chosen send fails both sides in the same collective; a held
// message makes a deadline fire at that deadline and not before; a message released by a
// later operation arrives after it. Every fault is placed by counting operations, so each test
// has exactly one outcome.
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <cstring>
#include <vector>

#include "rank_threads.h"
#include "weightlift/comm/collectives/collectives.h"
#include "weightlift/comm/transport/fault_transport.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;

// `size` thread-ranks, each with a Group over its own FaultTransport: fn(rank, group,
// faults). No closing barrier: these ranks are meant to fail; each test meets where it must.
void run_faulty(int size, const std::function<void(int, Group&, FaultTransport&)>& fn) {
  auto store = std::make_shared<MemoryStore>();
  testing::run_ranks(size, [&](int rank) {
    auto t = FaultTransport::create({.name = "rank " + std::to_string(rank)});
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    auto g = Group::connect({.store = store,
                             .rank = rank,
                             .size = size,
                             .timeout = 20s,
                             .transport = *t,
                             .ids_key = "ids"});
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    fn(rank, **g, **t);
  });
}

bool names(const Status& s, const std::string& who) {
  return s.message().find(who) != std::string::npos;
}

// ---- fail ----------------------------------------------------------------------------------

TEST(FaultTransport, TheNthPutFailsNamingItsPeerAndTheOthersLand) {
  constexpr size_t kPiece = 4099;  // odd, so that pieces are not aligned
  constexpr int kPieces = 4;
  run_faulty(2, [&](int rank, Group& g, FaultTransport& t) {
    if (rank == 1) {
      std::vector<uint8_t> mem(kPiece * kPieces, 0);
      auto region = t.register_memory(mem.data(), mem.size());
      ASSERT_TRUE(region.ok()) << region.status().to_string();
      const uint64_t header[2] = {region->address(), region->packed_rkey().size()};
      ASSERT_TRUE(g.send({.data = header, .bytes = sizeof header, .peer = 0, .tag = 1}).ok());
      ASSERT_TRUE(
          g.send({.data = region->packed_rkey().data(), .bytes = header[1], .peer = 0, .tag = 2})
              .ok());
      // Rank 0 says when its puts are flushed; they move while this rank waits (TCP).
      uint8_t done = 0;
      ASSERT_TRUE(g.recv({.data = &done, .bytes = 1, .peer = 0, .tag = 3}).ok());
      for (int i = 0; i < kPieces; ++i) {
        const uint8_t want = i == 2 ? 0 : uint8_t(i + 1);  // the third put never happened
        for (size_t b = 0; b < kPiece; ++b) ASSERT_EQ(mem[i * kPiece + b], want) << i << " " << b;
      }
      return;
    }
    uint64_t header[2] = {};
    ASSERT_TRUE(g.recv({.data = header, .bytes = sizeof header, .peer = 1, .tag = 1}).ok());
    std::vector<std::byte> packed(header[1]);
    ASSERT_TRUE(g.recv({.data = packed.data(), .bytes = packed.size(), .peer = 1, .tag = 2}).ok());
    const int peer = g.worker_peer(1);
    auto key = t.unpack_rkey(peer, packed);
    ASSERT_TRUE(key.ok()) << key.status().to_string();
    std::vector<uint8_t> src(kPiece * kPieces);
    for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i / kPiece + 1);

    t.fail({.op = TransportOp::kPut, .nth = 3});
    const int64_t before = t.count(TransportOp::kPut);
    for (int i = 0; i < kPieces; ++i) {
      // Each put waited for alone: the failed one has nothing in flight beside it, so the
      // connection survives it (a failed wait closes the connections its other requests use).
      Request put = t.put(peer, src.data() + i * kPiece, kPiece, header[0] + i * kPiece, *key);
      Status s = t.wait(put, deadline_after(10s));
      if (i != 2) {
        ASSERT_TRUE(s.ok()) << "put " << i << ": " << s.to_string();
        continue;
      }
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
      EXPECT_TRUE(names(s, "put 4099 bytes to rank 1")) << s.to_string();
      EXPECT_TRUE(names(s, "injected failure")) << s.to_string();
    }
    EXPECT_EQ(t.count(TransportOp::kPut) - before, kPieces);
    Request flush = t.flush(peer);
    ASSERT_TRUE(t.wait(flush, deadline_after(10s)).ok());
    const uint8_t done = 1;
    ASSERT_TRUE(g.send({.data = &done, .bytes = 1, .peer = 1, .tag = 3}).ok());
  });
}

// ---- drop ----------------------------------------------------------------------------------

// Rank 1 "dies": it takes no part, and ranks 0 and 2 have dropped it. Every collective then
// fails at once with kUnavailable naming it, long before its 20 s deadline.
TEST(FaultTransport, ADroppedPeerFailsEveryCollectiveAtOnceNamingIt) {
  std::barrier done(3);
  run_faulty(3, [&](int rank, Group& g, FaultTransport& t) {
    if (rank == 1) {
      done.arrive_and_wait();
      return;
    }
    t.drop_peer(g.worker_peer(1));
    EXPECT_EQ(t.peer_status(g.worker_peer(1)).code(), StatusCode::kUnavailable);
    std::vector<float> x(1000, 1.0f);
    std::vector<float> all(3 * x.size());
    const std::vector<std::function<Status()>> collectives = {
        [&] { return allreduce(g, {.recv = x.data(), .count = x.size()}); },
        [&] { return allgather(g, {.send = x.data(), .recv = all.data(), .count = x.size()}); },
        [&] { return broadcast(g, {.buffer = x.data(), .count = x.size(), .root = 0}); },
        [&] { return barrier(g); },
    };
    for (size_t i = 0; i < collectives.size(); ++i) {
      const auto start = Clock::now();
      Status s = collectives[i]();
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << "collective " << i << ": " << s.to_string();
      EXPECT_TRUE(names(s, "connection to rank 1 failed")) << s.to_string();
      EXPECT_LT(Clock::now() - start, 5s) << "rank " << rank << ", collective " << i
                                          << " waited for its deadline: " << s.to_string();
    }
    done.arrive_and_wait();
  });
}

// The link between two ranks breaks at each one's third send: two allreduces (one send each,
// recursive doubling on two ranks) go through, the third fails on both sides, each naming the
// other, at once.
TEST(FaultTransport, ALinkDroppedAtTheThirdSendFailsTheThirdCollectiveOnBothSides) {
  std::barrier step(2);
  run_faulty(2, [&](int rank, Group& g, FaultTransport& t) {
    const int other = 1 - rank;
    t.drop_peer_at(g.worker_peer(other), {.op = TransportOp::kSend, .nth = 3});
    for (int i = 0; i < 4; ++i) {
      std::vector<int32_t> x(777, rank + 1);
      const auto start = Clock::now();
      Status s = allreduce(g, {.recv = x.data(),
                               .count = x.size(),
                               .dtype = DType::kI32,
                               .algorithm = AllreduceAlgorithm::kRecursiveDoubling});
      if (i < 2) {
        ASSERT_TRUE(s.ok()) << "allreduce " << i << ": " << s.to_string();
        EXPECT_EQ(x, std::vector<int32_t>(777, 3));
      } else {
        EXPECT_EQ(s.code(), StatusCode::kUnavailable) << "allreduce " << i << ": " << s.to_string();
        EXPECT_TRUE(names(s, "connection to rank " + std::to_string(other) + " failed"))
            << s.to_string();
        EXPECT_LT(Clock::now() - start, 5s);
      }
      // Both ranks end each allreduce before either starts the next: a rank that fails closes
      // its connections, which must not reach the other while that one still finishes.
      step.arrive_and_wait();
    }
    EXPECT_EQ(t.count(TransportOp::kSend), 4);
  });
}

// ---- hold ----------------------------------------------------------------------------------

// Rank 1's half of an allreduce is held back. Rank 1 finishes (it has rank 0's half; a held
// send reports complete), rank 0 fails with kDeadlineExceeded naming rank 1 at its 300 ms
// deadline: not before it, and not long after.
TEST(FaultTransport, AHeldMessageMakesTheDeadlineFireThenAndNotBefore) {
  constexpr auto kTimeout = 300ms;
  std::barrier done(2);
  run_faulty(2, [&](int rank, Group& g, FaultTransport& t) {
    std::vector<float> x(100, float(rank + 1));
    const AllreduceOptions o{.recv = x.data(),
                             .count = x.size(),
                             .timeout = kTimeout,
                             .algorithm = AllreduceAlgorithm::kRecursiveDoubling};
    if (rank == 1) {
      t.hold({.op = TransportOp::kSend, .peer = g.worker_peer(0)}, {.nth = 0});
      Status s = allreduce(g, o);
      EXPECT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(x, std::vector<float>(100, 3.0f));
    } else {
      const auto start = Clock::now();
      Status s = allreduce(g, o);
      const auto took = Clock::now() - start;
      EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
      EXPECT_TRUE(names(s, "from rank 1")) << s.to_string();
      EXPECT_GE(took, kTimeout);
      // Scheduling slack on a loaded machine; the wait checks its clock every few microseconds.
      EXPECT_LT(took, kTimeout + 2s);
    }
    done.arrive_and_wait();  // rank 1 keeps its (held) message until rank 0 has given up
  });
}

// Two messages with the same tag: the first is held until the second has been sent, so the
// receiver's first receive gets the second one.
TEST(FaultTransport, AHeldMessageIsOvertakenByTheOneThatReleasesIt) {
  run_faulty(2, [&](int rank, Group& g, FaultTransport& t) {
    if (rank == 0) {
      const int p = g.worker_peer(1);
      t.hold({.op = TransportOp::kSend, .peer = p}, {.op = TransportOp::kSend, .peer = p});
      for (uint32_t v : {1u, 2u}) {
        ASSERT_TRUE(g.send({.data = &v, .bytes = 4, .peer = 1, .tag = 5}).ok());
      }
      uint8_t done = 0;
      ASSERT_TRUE(g.recv({.data = &done, .bytes = 1, .peer = 1, .tag = 6}).ok());
      return;
    }
    uint32_t first = 0, second = 0;
    ASSERT_TRUE(g.recv({.data = &first, .bytes = 4, .peer = 0, .tag = 5}).ok());
    ASSERT_TRUE(g.recv({.data = &second, .bytes = 4, .peer = 0, .tag = 5}).ok());
    EXPECT_EQ(first, 2u);
    EXPECT_EQ(second, 1u);
    const uint8_t done = 1;
    ASSERT_TRUE(g.send({.data = &done, .bytes = 1, .peer = 0, .tag = 6}).ok());
  });
}

// Rank 1's half of an allreduce is held until its next receive from rank 0, which is the
// first operation of the barrier it enters next: rank 0's allreduce (20 s deadline) can only
// complete after rank 1 has entered that barrier.
TEST(FaultTransport, AMessageHeldUntilALaterOperationCompletesTheWaitOnlyThen) {
  std::atomic<bool> in_barrier{false};
  run_faulty(2, [&](int rank, Group& g, FaultTransport& t) {
    std::vector<float> x(100, float(rank + 1));
    const AllreduceOptions o{
        .recv = x.data(), .count = x.size(), .algorithm = AllreduceAlgorithm::kRecursiveDoubling};
    if (rank == 1) {
      const int p = g.worker_peer(0);
      t.hold({.op = TransportOp::kSend, .peer = p}, {.op = TransportOp::kRecv, .peer = p});
      ASSERT_TRUE(allreduce(g, o).ok());
      in_barrier = true;
    } else {
      Status s = allreduce(g, o);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(in_barrier.load()) << "the held half arrived before its release";
    }
    EXPECT_EQ(x, std::vector<float>(100, 3.0f));
    Status s = barrier(g);
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
}

}  // namespace
}  // namespace wl::comm
