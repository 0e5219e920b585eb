// Ranks as threads: each thread is one rank with its own UCX worker, and they meet through a
// MemoryStore. gtest's EXPECT_* macros are thread-safe, so each rank checks its own results.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/comm/store/memory_store.h"

namespace wl::comm::testing {

inline void run_ranks(int size, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(size_t(size));
  for (int r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// Connects a world of `size` thread-ranks and runs fn(group) on each. The ranks meet in a
// barrier before tearing down, so no rank closes its connections while another still needs
// them.
inline void run_world(int size, const std::function<void(Group&)>& fn,
                      std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  auto store = std::make_shared<MemoryStore>();
  run_ranks(size, [&](int rank) {
    auto g = Group::connect({.store = store, .rank = rank, .size = size, .timeout = timeout});
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    fn(**g);
    Status s = barrier(**g);
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
}

// As run_world, rank r counting as being on host hosts[r] (ConnectOptions::host; nonzero):
// threads of one process standing for ranks on several hosts.
inline void run_world_on_hosts(const std::vector<uint64_t>& hosts,
                               const std::function<void(Group&)>& fn,
                               std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  auto store = std::make_shared<MemoryStore>();
  const int size = int(hosts.size());
  run_ranks(size, [&](int rank) {
    auto g = Group::connect({.store = store,
                             .rank = rank,
                             .size = size,
                             .timeout = timeout,
                             .host = hosts[size_t(rank)]});
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    fn(**g);
    Status s = barrier(**g);
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
}

}  // namespace wl::comm::testing
