// What the fleet tests share (fleet_test.cc, fleet_heal_test.cc): receivers and server ranks
// as threads on one store, a healer, and small waits.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fixture.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/heal_from_servers.h"
#include "weightlift/transfer/fleet/parameter_server.h"

namespace wl::transfer::fleet_testing {

using namespace std::chrono_literals;

inline constexpr int kServers = 2;

// A receiver thread: serves rounds until stopped; errors are collected, not fatal (a
// failed update is a legitimate outcome the tests look at). Around every round, canaries
// check that no write strayed outside the slot's tensors (fixture.h).
struct ReceiverThread {
  std::unique_ptr<FleetReceiver> fleet;
  LayoutOptions layout;
  std::atomic<bool> stop{false};
  std::thread thread;
  std::mutex mu;
  std::vector<std::string> errors;
  std::atomic<int> left_behind{0};  // updates that left it out as lagging

  void start() {
    thread = std::thread([this] {
      while (!stop.load()) {
        const testing::SlotCanary canary(fleet->receiver());
        auto r = fleet->serve_one(50ms);
        const bool no_round = !r.ok() && r.status().code() == StatusCode::kDeadlineExceeded &&
                              r.status().message().find("no round posted") != std::string::npos;
        if (!no_round) canary.expect_untouched();
        if (r.ok() && r->left_behind) ++left_behind;
        if (!r.ok() && r.status().code() != StatusCode::kDeadlineExceeded) {
          std::lock_guard lock(mu);
          errors.push_back(r.status().to_string());
        }
      }
    });
  }
  void join() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
  // Stops serving, then leaves (serve_one() and leave() are for one thread).
  Status leave() {
    join();
    return fleet->leave();
  }
  // Waits until the receiver holds `version`: servers return from an update when the final
  // allreduce completes, receivers publish right after theirs.
  bool wait_version(uint64_t version) {
    const auto deadline = comm::deadline_after(20s);
    while (fleet->receiver().version() != version && comm::Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    return fleet->receiver().version() == version;
  }
  // Waits until an update has left the receiver out as lagging (and it announced itself again).
  bool wait_left_behind() {
    const auto deadline = comm::deadline_after(20s);
    while (left_behind.load() == 0 && comm::Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    return left_behind.load() > 0;
  }
  // Waits until a round has failed here (the refuse round reaches a slow thread late).
  bool wait_error() {
    const auto deadline = comm::deadline_after(20s);
    for (;;) {
      {
        std::lock_guard lock(mu);
        if (!errors.empty()) return true;
      }
      if (comm::Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(1ms);
    }
  }
};

// A receiver holding `tensors` at `layout`'s TP rank and format.
inline std::unique_ptr<ReceiverThread> start_receiver(std::shared_ptr<comm::Store> store,
                                                      const std::vector<ReceiverTensor>& tensors,
                                                      int id, LayoutOptions layout) {
  auto t = std::make_unique<ReceiverThread>();
  t->layout = layout;
  auto f = FleetReceiver::create({.store = store,
                                  .id = id,
                                  .receiver = {.tensors = tensor_specs(tensors),
                                               .tp = layout.tp,
                                               .tp_rank = layout.tp_rank,
                                               .format = layout.format},
                                  .timeout = 20s});
  WL_CHECK(f.ok()) << f.status().to_string();
  t->fleet = std::move(*f);
  t->start();
  return t;
}

// A receiver holding our model's inference layout.
inline std::unique_ptr<ReceiverThread> start_receiver(std::shared_ptr<comm::Store> store,
                                                      const model::ModelConfig& c, int id,
                                                      LayoutOptions layout) {
  auto lay = inference_layout(c, layout);
  WL_CHECK(lay.ok()) << lay.status().to_string();
  return start_receiver(std::move(store), *lay, id, layout);
}

// Runs fn(server) on kServers threads, each with its ParameterServer.
inline void run_servers(std::shared_ptr<comm::Store> store, TransferMode mode,
                        const std::function<void(ParameterServer&)>& fn,
                        DType shard_dtype = DType::kF32) {
  std::vector<std::thread> threads;
  for (int r = 0; r < kServers; ++r) {
    threads.emplace_back([&, r] {
      auto ps = ParameterServer::create({.store = store,
                                         .rank = r,
                                         .size = kServers,
                                         .timeout = 20s,
                                         .join_timeout = 2s,
                                         .mode = mode,
                                         .bucket_bytes = 1 << 16,
                                         .shard_dtype = shard_dtype});
      ASSERT_TRUE(ps.ok()) << ps.status().to_string();
      fn(**ps);
    });
  }
  for (auto& t : threads) t.join();
}

// The servers' copy records, as a healer reads them from the store.
inline std::vector<ServerCopyRecord> server_copy_records(comm::Store& store) {
  auto records = read_server_copies(store, FleetKeys{"fleet"});
  WL_CHECK(records.ok()) << records.status().to_string();
  EXPECT_EQ(int(records->size()), kServers);
  return *std::move(records);
}

struct Healer {
  std::unique_ptr<comm::Worker> worker;
  std::unique_ptr<Receiver> receiver;
  LayoutOptions layout;
  explicit Healer(const model::ModelConfig& c, LayoutOptions l = {.tp = 2, .tp_rank = 1})
      : layout(l) {
    auto lay = inference_layout(c, layout);
    WL_CHECK(lay.ok());
    auto w = comm::Worker::create({.name = "healer"});
    WL_CHECK(w.ok());
    worker = std::move(*w);
    auto r = Receiver::create(*worker, {.tensors = tensor_specs(*lay),
                                        .tp = layout.tp,
                                        .tp_rank = layout.tp_rank,
                                        .format = layout.format});
    WL_CHECK(r.ok());
    receiver = std::move(*r);
  }
  // heal_from_servers into this receiver, with canaries (fixture.h) checked after it, whatever
  // the outcome: the copy lands in one slot's tensors, nowhere else.
  Result<uint64_t> heal(std::span<const ServerCopyRecord> records, const HealOptions& o = {}) {
    const testing::SlotCanary canary(*receiver);
    Result<uint64_t> v = heal_from_servers(*worker, *receiver, records, o);
    canary.expect_untouched();
    return v;
  }
};

// Sets `flag` to `value` however the thread holding it ends (an ASSERT returns early), so the
// threads waiting on that flag never wait forever.
struct SetOnExit {
  std::atomic<int>& flag;
  int value;
  ~SetOnExit() { flag = value; }
};

// Waits (30 s at most) until every server rank has counted its first update into `published`.
inline bool all_servers_published(const std::atomic<int>& published) {
  const auto deadline = comm::deadline_after(30s);
  while (published.load() < kServers && comm::Clock::now() < deadline) {
    std::this_thread::yield();
  }
  return published.load() == kServers;
}

}  // namespace wl::transfer::fleet_testing
