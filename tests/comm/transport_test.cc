// Transport over UCX between two workers on two threads: tagged messages, one-sided put and
// get with flush, and the failure paths a wait must turn into a Status (timeout, size
// mismatch, a peer that has gone). Runs under the default transports and, as a second CTest
// entry, under UCX_TLS=tcp where the target has to progress for anything to move.
#include "weightlift/comm/transport/transport.h"

#include <gtest/gtest.h>

#include <array>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "rank_threads.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;
using testing::run_ranks;

// Two workers on two threads, connected to each other; `fn(rank, worker, peer)` runs on each.
void run_pair(const std::function<void(int, Worker&, int)>& fn) {
  std::array<std::unique_ptr<Worker>, 2> workers;
  std::barrier sync(2);
  run_ranks(2, [&](int rank) {
    auto w = Worker::create({.name = "rank " + std::to_string(rank)});
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    workers[size_t(rank)] = std::move(*w);
    sync.arrive_and_wait();
    auto peer = workers[size_t(rank)]->connect(workers[size_t(1 - rank)]->address(),
                                               "rank " + std::to_string(1 - rank));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    sync.arrive_and_wait();
    fn(rank, *workers[size_t(rank)], *peer);
    // Keep both workers alive until both ranks are done with them.
    sync.arrive_and_wait();
    workers[size_t(rank)].reset();
  });
}

TEST(Transport, TaggedMessagesOfManySizes) {
  run_pair([](int rank, Worker& w, int peer) {
    for (size_t bytes : {size_t(0), size_t(1), size_t(13), size_t(4096), size_t(3) << 20}) {
      std::vector<uint8_t> buf(bytes + 1, 0xee);  // +1: a guard byte that must survive
      if (rank == 0) {
        for (size_t i = 0; i < bytes; ++i) buf[i] = uint8_t(i * 7 + 3);
        Request r = w.send(peer, 42 + bytes, buf.data(), bytes);
        ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      } else {
        Request r = w.recv(peer, 42 + bytes, buf.data(), bytes);
        Status s = w.wait(r, deadline_after(10s));
        ASSERT_TRUE(s.ok()) << s.to_string();
        for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(buf[i], uint8_t(i * 7 + 3)) << i;
        EXPECT_EQ(buf[bytes], 0xee);
      }
    }
  });
}

TEST(Transport, TagsKeepMessagesApart) {
  // Two messages posted in one order, received in the other: each lands by tag.
  run_pair([](int rank, Worker& w, int peer) {
    int64_t a = 0, b = 0;
    std::vector<Request> rs;
    if (rank == 0) {
      a = 111, b = 222;
      rs.push_back(w.send(peer, 1, &a, 8));
      rs.push_back(w.send(peer, 2, &b, 8));
    } else {
      rs.push_back(w.recv(peer, 2, &b, 8));
      rs.push_back(w.recv(peer, 1, &a, 8));
    }
    ASSERT_TRUE(w.wait_all(rs, deadline_after(10s)).ok());
    EXPECT_EQ(a, 111);
    EXPECT_EQ(b, 222);
  });
}

TEST(Transport, PutThenGetThroughRegisteredMemory) {
  // Rank 1 exposes a region; rank 0 writes into it, flushes, and says so by message; rank 1,
  // which progresses while it waits for that message, then finds the bytes in place. Rank 0
  // then reads the region back with get.
  constexpr size_t kBytes = (1 << 20) + 5;
  run_pair([](int rank, Worker& w, int peer) {
    std::vector<uint8_t> mem(kBytes);
    if (rank == 1) {
      std::iota(mem.begin(), mem.end(), uint8_t(0));
      auto region = w.register_memory(mem.data(), mem.size());
      ASSERT_TRUE(region.ok()) << region.status().to_string();
      uint64_t addr = region->address();
      uint64_t rkey_len = region->packed_rkey().size();
      std::vector<Request> rs;
      rs.push_back(w.send(peer, 1, &addr, 8));
      rs.push_back(w.send(peer, 2, &rkey_len, 8));
      rs.push_back(w.send(peer, 3, region->packed_rkey().data(), rkey_len));
      ASSERT_TRUE(w.wait_all(rs, deadline_after(10s)).ok());
      uint8_t done = 0;
      Request r = w.recv(peer, 4, &done, 1);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(mem[i], uint8_t(255 - i % 251)) << i;
      // Stay progressing while rank 0 reads the region back.
      r = w.recv(peer, 5, &done, 1);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
    } else {
      uint64_t addr = 0, rkey_len = 0;
      Request r = w.recv(peer, 1, &addr, 8);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      r = w.recv(peer, 2, &rkey_len, 8);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      std::vector<std::byte> packed(rkey_len);
      r = w.recv(peer, 3, packed.data(), rkey_len);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      auto rkey = w.unpack_rkey(peer, packed);
      ASSERT_TRUE(rkey.ok()) << rkey.status().to_string();

      for (size_t i = 0; i < kBytes; ++i) mem[i] = uint8_t(255 - i % 251);
      // Unaligned pieces at unaligned remote offsets: three puts cover the region.
      std::vector<Request> puts;
      puts.push_back(w.put(peer, mem.data(), 3, addr, *rkey));
      puts.push_back(w.put(peer, mem.data() + 3, 1000, addr + 3, *rkey));
      puts.push_back(w.put(peer, mem.data() + 1003, kBytes - 1003, addr + 1003, *rkey));
      puts.push_back(w.flush(peer));
      Status s = w.wait_all(puts, deadline_after(10s));
      ASSERT_TRUE(s.ok()) << s.to_string();
      uint8_t done = 1;
      r = w.send(peer, 4, &done, 1);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());

      std::vector<uint8_t> back(kBytes, 0);
      std::vector<Request> gets;
      gets.push_back(w.get(peer, back.data() + 1, kBytes - 1, addr + 1, *rkey));
      gets.push_back(w.flush(peer));
      s = w.wait_all(gets, deadline_after(10s));
      ASSERT_TRUE(s.ok()) << s.to_string();
      for (size_t i = 1; i < kBytes; ++i) ASSERT_EQ(back[i], uint8_t(255 - i % 251)) << i;
      r = w.send(peer, 5, &done, 1);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
    }
  });
}

TEST(Transport, AllocatedMemoryIsLoadAndStoreAccessibleOnOneHost) {
  // Rank 1 allocates a region through UCX and hands over its rkey; rank 0 asks for a direct
  // pointer. Over shared memory there must be one, and stores through it must show up in
  // rank 1's region; over TCP there is none, and asking must say so with null, not crash.
  const char* tls = std::getenv("UCX_TLS");
  const bool tcp_only = tls != nullptr && std::string(tls) == "tcp";
  constexpr size_t kBytes = 3 * 4096 + 17;
  run_pair([tcp_only](int rank, Worker& w, int peer) {
    if (rank == 1) {
      auto region = w.allocate_memory(kBytes);
      ASSERT_TRUE(region.ok()) << region.status().to_string();
      auto* bytes = static_cast<uint8_t*>(region->data());
      for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(bytes[i], 0) << "not zero-filled at " << i;
      uint64_t header[2] = {region->address(), region->packed_rkey().size()};
      std::vector<Request> rs;
      rs.push_back(w.send(peer, 1, header, sizeof header));
      rs.push_back(w.send(peer, 2, region->packed_rkey().data(), header[1]));
      ASSERT_TRUE(w.wait_all(rs, deadline_after(10s)).ok());
      uint8_t mapped = 0;
      Request r = w.recv(peer, 3, &mapped, 1);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      if (mapped) {
        for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(bytes[i], uint8_t(i * 13 + 1)) << i;
      }
    } else {
      uint64_t header[2] = {};
      Request r = w.recv(peer, 1, header, sizeof header);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      std::vector<std::byte> packed(header[1]);
      r = w.recv(peer, 2, packed.data(), packed.size());
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
      auto rkey = w.unpack_rkey(peer, packed);
      ASSERT_TRUE(rkey.ok()) << rkey.status().to_string();
      auto* p = static_cast<uint8_t*>(w.remote_pointer(*rkey, header[0]));
      if (tcp_only) {
        EXPECT_EQ(p, nullptr) << "a direct pointer over TCP";
      } else {
        ASSERT_NE(p, nullptr) << "no direct pointer over shared memory";
      }
      if (p != nullptr) {
        for (size_t i = 0; i < kBytes; ++i) p[i] = uint8_t(i * 13 + 1);
      }
      uint8_t mapped = p != nullptr;
      r = w.send(peer, 3, &mapped, 1);
      ASSERT_TRUE(w.wait(r, deadline_after(10s)).ok());
    }
  });
}

TEST(Transport, WaitTimesOutNamingPeerAndOperation) {
  run_pair([](int rank, Worker& w, int peer) {
    if (rank != 0) return;
    int64_t x = 0;
    Request r = w.recv(peer, 99, &x, 8);
    const auto start = Clock::now();
    Status s = w.wait(r, deadline_after(200ms));
    const auto took = Clock::now() - start;
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
    EXPECT_NE(s.message().find("recv 8 bytes from rank 1"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s.message();
    EXPECT_LT(took, 3s);
    EXPECT_FALSE(r.pending());
    // The connection is closed after a timeout: later operations fail at once.
    Request again = w.send(peer, 1, &x, 8);
    EXPECT_EQ(w.wait(again, deadline_after(5s)).code(), StatusCode::kAborted);
  });
}

TEST(Transport, SizeMismatchIsDataLoss) {
  run_pair([](int rank, Worker& w, int peer) {
    std::array<int64_t, 2> buf{1, 2};
    if (rank == 0) {
      std::vector<Request> rs;
      rs.push_back(w.send(peer, 7, buf.data(), 16));  // longer than the receiver's buffer
      rs.push_back(w.send(peer, 8, buf.data(), 8));   // shorter than the receiver expects
      EXPECT_TRUE(w.wait_all(rs, deadline_after(10s)).ok());
    } else {
      Request r = w.recv(peer, 7, buf.data(), 8);
      Status s = w.wait(r, deadline_after(10s));
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
      r = w.recv(peer, 8, buf.data(), 16);
      s = w.wait(r, deadline_after(10s));
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
      EXPECT_NE(s.message().find("received 8 bytes"), std::string::npos) << s.message();
    }
  });
}

}  // namespace
}  // namespace wl::comm
