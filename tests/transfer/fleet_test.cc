// The parameter server and its fleet, with every rank a thread (fleet_process_test.cc kills
// real processes): named checkpoints switched between, receivers joining, healing from a
// peer, leaving, in p2p and broadcast mode, every version bit-exact against the reference.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "fixture.h"
#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/heal_from_servers.h"
#include "weightlift/transfer/fleet/parameter_server.h"

namespace wl::transfer {
namespace {

using namespace std::chrono_literals;
using testing::expect_matches_reference;
using testing::preset_or_die;
using testing::random_weights;

constexpr int kServers = 2;

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

  void start() {
    thread = std::thread([this] {
      while (!stop.load()) {
        const testing::SlotCanary canary(fleet->receiver());
        auto r = fleet->serve_one(50ms);
        const bool no_round = !r.ok() && r.status().code() == StatusCode::kDeadlineExceeded &&
                              r.status().message().find("no round posted") != std::string::npos;
        if (!no_round) canary.expect_untouched();
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
std::unique_ptr<ReceiverThread> start_receiver(std::shared_ptr<comm::Store> store,
                                               const std::vector<ReceiverTensor>& tensors, int id,
                                               LayoutOptions layout) {
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
std::unique_ptr<ReceiverThread> start_receiver(std::shared_ptr<comm::Store> store,
                                               const model::ModelConfig& c, int id,
                                               LayoutOptions layout) {
  auto lay = inference_layout(c, layout);
  WL_CHECK(lay.ok()) << lay.status().to_string();
  return start_receiver(std::move(store), *lay, id, layout);
}

// Runs fn(server) on kServers threads, each with its ParameterServer.
void run_servers(std::shared_ptr<comm::Store> store, TransferMode mode,
                 const std::function<void(ParameterServer&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < kServers; ++r) {
    threads.emplace_back([&, r] {
      auto ps = ParameterServer::create({.store = store,
                                         .rank = r,
                                         .size = kServers,
                                         .timeout = 20s,
                                         .join_timeout = 2s,
                                         .mode = mode,
                                         .bucket_bytes = 1 << 16});
      ASSERT_TRUE(ps.ok()) << ps.status().to_string();
      fn(**ps);
    });
  }
  for (auto& t : threads) t.join();
}

void switch_join_heal_leave(TransferMode mode, WeightFormat format) {
  SCOPED_TRACE(std::string(transfer_mode_name(mode)) + " " +
               std::string(weight_format_name(format)));
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  // One engine of TP 2 (receivers 0 and 1); receiver 2 later joins as a replica of TP rank 0.
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) {
    rx.push_back(start_receiver(store, c, i, {.tp = 2, .tp_rank = i, .format = format}));
  }
  auto expect_all = [&](std::span<const float> held, uint64_t v) {
    for (auto& t : rx) {
      if (t == nullptr) continue;
      ASSERT_TRUE(t->wait_version(v)) << "receiver stuck at " << t->fleet->receiver().version();
      expect_matches_reference(t->fleet->receiver(), c, t->layout, held, v);
    }
  };
  std::atomic<int> phase{0};
  run_servers(store, mode, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
    EXPECT_EQ(ps.checkpoints(), (std::vector<std::string>{"a", "b"}));
    EXPECT_EQ(ps.register_checkpoint("a", c, a).code(), StatusCode::kInvalidArgument);

    // Switching between named checkpoints: a, b, a.
    for (const char* name : {"a", "b", "a"}) {
      auto u = ps.update(name);
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      EXPECT_EQ(u->members.size(), 2u);
    }
    EXPECT_EQ(ps.generation(), 1u) << "same receivers: one generation throughout";
    if (ps.options().rank == 0) {
      expect_all(a, 3);
      // A late joiner heals from its peer of the same shard before anyone writes to it.
      rx.push_back(start_receiver(store, c, 2, {.tp = 2, .tp_rank = 0, .format = format}));
      EXPECT_EQ(rx[2]->fleet->healed_version(), 3u) << rx[2]->fleet->heal_log();
      expect_matches_reference(rx[2]->fleet->receiver(), c, rx[2]->layout, a, 3);
      phase = 1;
    }
    while (phase.load() < 1) std::this_thread::yield();

    auto u = ps.update("b");  // the plan follows: a new generation with three receivers
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(u->members.size(), 3u);
    EXPECT_EQ(ps.generation(), 2u);
    if (ps.options().rank == 0) {
      expect_all(b, 4);
      ASSERT_TRUE(rx[1]->fleet->leave().ok());  // leaves between updates, while serving
      phase = 2;
    }
    while (phase.load() < 2) std::this_thread::yield();
    // Only receivers 0 and 2 (both TP rank 0) remain: a, for the two of them.
    u = ps.update("a");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(u->members.size(), 2u);

    // Bad requests, refused before any round is posted.
    EXPECT_EQ(ps.update("nope").status().code(), StatusCode::kNotFound);
    const int stranger[] = {7};
    auto s = ps.update("a", stranger);
    EXPECT_EQ(s.status().code(), StatusCode::kNotFound) << s.status().to_string();
    if (ps.options().rank == 0) {
      EXPECT_NE(s.status().message().find("receiver 7"), std::string::npos);
    }
    EXPECT_TRUE(ps.unregister_checkpoint("b").ok());
    EXPECT_EQ(ps.unregister_checkpoint("b").code(), StatusCode::kNotFound);
    EXPECT_EQ(ps.update("b").status().code(), StatusCode::kNotFound);
  });
  ASSERT_TRUE(rx[0]->wait_version(5));
  expect_matches_reference(rx[0]->fleet->receiver(), c, rx[0]->layout, a, 5);
  expect_matches_reference(rx[2]->fleet->receiver(), c, rx[2]->layout, a, 5);
  EXPECT_EQ(rx[1]->fleet->receiver().version(), 4u) << "left before version 5";
  expect_matches_reference(rx[1]->fleet->receiver(), c, rx[1]->layout, b, 4);
  for (auto& t : rx) {
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// A receiver of another model's layout, and a second receiver taking an id a live one holds
// (the holder answers the form round that asks them both), are turned away at the next update,
// each told why; the others are updated as if they had never joined (before, the first failed
// every update at planning and the second left both holders of the id without weights).
TEST(ParameterServer, AReceiverThatCannotBeServedIsTurnedAwayAndTheOthersUpdate) {
  const model::ModelConfig c = preset_or_die("tiny");
  const model::ModelConfig other = preset_or_die("small");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  rx.push_back(start_receiver(store, c, 0, {}));
  rx.push_back(start_receiver(store, other, 1, {}));  // small's layout: no checkpoint of it
  rx.push_back(start_receiver(store, c, 0, {}));      // receiver 0's id, while 0 lives
  rx.push_back(start_receiver(store, c, 2, {}));
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("policy", c, a).ok());
    auto ids = [](const ServerUpdate& u) {
      std::vector<int> out;
      for (const FleetMember& m : u.members) out.push_back(m.id);
      return out;
    };
    auto u = ps.update("policy");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(ids(*u), (std::vector<int>{0, 2}));
    ASSERT_TRUE(ps.refresh("policy", b).ok());
    u = ps.update("policy");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(ids(*u), (std::vector<int>{0, 2}));
    EXPECT_EQ(ps.generation(), 1u) << "the turned-away never made a new generation";
  });
  for (int i : {0, 3}) {
    ASSERT_TRUE(rx[size_t(i)]->wait_version(2));
    expect_matches_reference(rx[size_t(i)]->fleet->receiver(), c, {}, b, 2);
  }
  for (int i : {1, 2}) EXPECT_TRUE(rx[size_t(i)]->wait_error()) << "receiver " << i;
  for (auto& t : rx) t->join();
  EXPECT_TRUE(rx[0]->errors.empty()) << rx[0]->errors.front();
  EXPECT_TRUE(rx[3]->errors.empty()) << rx[3]->errors.front();
  auto refused_once = [](ReceiverThread& t, const std::vector<std::string>& fragments) {
    ASSERT_FALSE(t.errors.empty()) << "not turned away";
    for (const std::string& e : t.errors) {  // every call after the refusal: the same reason
      EXPECT_NE(e.find("PermissionDenied"), std::string::npos) << e;
      for (const std::string& f : fragments) EXPECT_NE(e.find(f), std::string::npos) << e;
    }
    EXPECT_EQ(t.fleet->receiver().version(), 0u);
  };
  refused_once(*rx[1], {"receiver 1 was turned away", "not checkpoint 'policy''s inference layout",
                        "embed.weight:BF16[320,256]"});
  refused_once(*rx[2], {"receiver 0 was turned away", "receiver id 0 is held by another receiver",
                        "which answered round 1", "another id"});
}

TEST(ParameterServer, SwitchJoinHealLeaveP2pBf16) {
  switch_join_heal_leave(TransferMode::kP2P, WeightFormat::kBF16);
}
TEST(ParameterServer, SwitchJoinHealLeaveP2pFp8) {
  switch_join_heal_leave(TransferMode::kP2P, WeightFormat::kFP8);
}
TEST(ParameterServer, SwitchJoinHealLeaveBroadcastFp8) {
  switch_join_heal_leave(TransferMode::kBroadcast, WeightFormat::kFP8);
}

// A state dict as PyTorch holds it: whole parameters by name, in bf16 or f32, copied straight
// into the shards (no f32 copy of the model on the way). The receivers get what the full f32
// vector of the same values gives; a refused set (a tensor missing, unknown, given twice, of
// the wrong shape or dtype) is named and changes nothing.
struct StateDict {
  std::vector<std::vector<uint16_t>> bf16;  // per parameter, when held in bf16
  std::vector<NamedTensor> tensors;
};

StateDict state_dict(const model::ModelConfig& c, const std::vector<float>& w, bool in_bf16) {
  StateDict d;
  const model::ParamLayout layout(c);
  d.bf16.resize(layout.params().size());
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const model::ParamInfo& p = layout.params()[i];
    const void* data = w.data() + p.offset;
    if (in_bf16) {
      d.bf16[i].resize(size_t(p.numel()));
      convert_f32_to_bf16(w.data() + p.offset, d.bf16[i].data(), size_t(p.numel()));
      data = d.bf16[i].data();
    }
    d.tensors.push_back({p.name, in_bf16 ? DType::kBF16 : DType::kF32, p.shape, data});
  }
  return d;
}

std::vector<float> widened_from_bf16(const std::vector<float>& w) {
  std::vector<uint16_t> h(w.size());
  std::vector<float> out(w.size());
  convert_f32_to_bf16(w.data(), h.data(), w.size());
  convert_bf16_to_f32(h.data(), out.data(), w.size());
  return out;
}

TEST(ParameterServer, TakesAStateDictInBf16OrF32) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  const StateDict a_bf16 = state_dict(c, a, true), b_f32 = state_dict(c, b, false);
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) rx.push_back(start_receiver(store, c, i, {.tp = 1, .tp_rank = 0}));
  auto expect_all = [&](std::span<const float> held, uint64_t v) {
    for (auto& t : rx) {
      ASSERT_TRUE(t->wait_version(v));
      expect_matches_reference(t->fleet->receiver(), c, t->layout, held, v);
    }
  };
  std::atomic<int> phase{0};
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a_bf16.tensors).ok());
    ASSERT_TRUE(ps.update("a").ok());
    if (ps.options().rank == 0) {
      expect_all(widened_from_bf16(a), 1);
      phase = 1;
    }
    while (phase.load() < 1) std::this_thread::yield();
    ASSERT_TRUE(ps.refresh("a", b_f32.tensors).ok());
    ASSERT_TRUE(ps.update("a").ok());
    if (ps.options().rank == 0) {
      expect_all(b, 2);
      phase = 2;
    }
    while (phase.load() < 2) std::this_thread::yield();

    const std::string first = b_f32.tensors[0].name, last = b_f32.tensors.back().name;
    auto refused = [&](std::vector<NamedTensor> t, const std::string& what) {
      const Status s = ps.refresh("a", t);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what;
      EXPECT_NE(s.message().find(what), std::string::npos) << s.to_string();
      EXPECT_EQ(ps.register_checkpoint("c", c, t).code(), StatusCode::kInvalidArgument) << what;
    };
    std::vector<NamedTensor> bad = a_bf16.tensors;
    bad.pop_back();
    refused(bad, "refresh 'a': tensor '" + last + "' is missing");
    bad = a_bf16.tensors;
    bad.push_back(bad[0]);
    refused(bad, "tensor '" + first + "' is given twice");
    bad = a_bf16.tensors;
    bad[0].shape.back() += 1;
    refused(bad, "tensor '" + first + "' has shape");
    bad = a_bf16.tensors;
    bad[0].dtype = DType::kI32;
    refused(bad, "tensor '" + first + "' is I32; parameters are F32 or BF16");
    bad = a_bf16.tensors;
    bad[0].name = "layers.9.nothing";
    refused(bad, "tensor 'layers.9.nothing' is not a parameter of the model");
    EXPECT_EQ(ps.checkpoints(), std::vector<std::string>{"a"});
    ASSERT_TRUE(ps.update("a").ok());  // still b
    if (ps.options().rank == 0) {
      expect_all(b, 3);
      phase = 3;
    }
    while (phase.load() < 3) std::this_thread::yield();
  });
  for (auto& t : rx) {
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// Another model's weights (a Llama with Hugging Face's names, by its layout spec) through the
// servers to a TP-2 engine in fp8: each version equals the reference; a refresh from a flat
// f32 array (our model's form) and a spec that cannot be split are refused naming why; the
// servers' copy for healing is our model's only, and the update says so.
TEST(ParameterServer, ServesALayoutSpecsModel) {
  const model::ModelConfig c = preset_or_die("tiny");
  const LayoutSpec spec = llama_hf_layout_spec(c, WeightFormat::kFP8);
  const auto a = testing::random_params(spec, 1), b = testing::random_params(spec, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) {
    const LayoutOptions o{.tp = 2, .tp_rank = i, .format = WeightFormat::kFP8};
    auto lay = spec_layout(spec, o.tp, o.tp_rank);
    ASSERT_TRUE(lay.ok()) << lay.status().to_string();
    rx.push_back(start_receiver(store, *lay, i, o));
  }
  auto expect_all = [&](const std::map<std::string, std::vector<float>>& held, uint64_t v) {
    for (auto& t : rx) {
      ASSERT_TRUE(t->wait_version(v));
      testing::expect_holds(t->fleet->receiver(),
                            reference_llama_hf_tensors(c, t->layout, held, spec.params), t->layout,
                            v);
    }
  };
  std::atomic<int> phase{0};
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", spec, testing::named(spec, a)).ok());
    auto u = ps.update("a");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_NE(u->copy_published.message().find("the servers' copy serves our model only"),
              std::string::npos)
        << u->copy_published.to_string();
    if (ps.options().rank == 0) {
      expect_all(a, 1);
      phase = 1;
    }
    while (phase.load() < 1) std::this_thread::yield();
    ASSERT_TRUE(ps.refresh("a", testing::named(spec, b)).ok());
    ASSERT_TRUE(ps.update("a").ok());
    if (ps.options().rank == 0) {
      expect_all(b, 2);
      phase = 2;
    }
    while (phase.load() < 2) std::this_thread::yield();

    const Status flat = ps.refresh("a", std::vector<float>(16));
    EXPECT_NE(flat.message().find("layout 'llama-hf''s weights, not our model's"),
              std::string::npos)
        << flat.to_string();
    LayoutSpec odd = spec;
    SpecTensor& qkv =
        *std::find_if(odd.tensors.begin(), odd.tensors.end(),
                      [](const SpecTensor& t) { return t.name.ends_with("qkv_proj.weight"); });
    qkv.head_dim = 48;  // its sources' rows are not whole heads of 48
    const Status s = ps.register_checkpoint("odd", odd, testing::named(spec, a));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("register_checkpoint 'odd'"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find(qkv.name), std::string::npos) << s.to_string();
    EXPECT_EQ(ps.checkpoints(), std::vector<std::string>{"a"});
  });
  for (auto& t : rx) {
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// A bf16 state dict into bf16 shards is a copy: the shards are the bytes the caller held, the
// same as rounding the f32 values would give.
TEST(TrainerWeights, Bf16TensorsIntoBf16ShardsAreCopied) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 4);
  const StateDict d = state_dict(c, a, true);
  const TrainerWeights named =
      TrainerWeights::from_named(c, d.tensors, nullptr, {.dtype = DType::kBF16});
  const TrainerWeights full = TrainerWeights::from_full(c, a, nullptr, {.dtype = DType::kBF16});
  ASSERT_EQ(named.tensors().size(), d.tensors.size());
  for (size_t i = 0; i < d.tensors.size(); ++i) {
    const Tensor& x = named.tensors()[i].shard();
    ASSERT_EQ(x.nbytes(), d.bf16[i].size() * 2);
    EXPECT_EQ(std::memcmp(x.raw(), d.bf16[i].data(), x.nbytes()), 0) << d.tensors[i].name;
    EXPECT_EQ(std::memcmp(x.raw(), full.tensors()[i].shard().raw(), x.nbytes()), 0);
  }
}

// A receiver left behind by updates to a subset is not silently mixed into a generation whose
// members hold a newer version: it is left out with an error telling it to restart, and once
// restarted it heals and rejoins.
TEST(ParameterServer, ALaggingReceiverIsLeftOutUntilItRestartsAndHeals) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1);
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) rx.push_back(start_receiver(store, c, i, {.tp = 1, .tp_rank = 0}));
  std::atomic<int> phase{0};
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    auto u = ps.update("a");  // both at version 1
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    const int only_0[] = {0};
    u = ps.update("a", only_0);  // receiver 0 at 2, receiver 1 left at 1
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    u = ps.update("a");  // both asked for
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    ASSERT_EQ(u->members.size(), 1u);
    EXPECT_EQ(u->members[0].id, 0);
    EXPECT_EQ(u->dropped, std::vector<int>{1});
    if (ps.options().rank == 0) {
      ASSERT_TRUE(rx[0]->wait_version(3));
      rx[1]->join();
      ASSERT_EQ(rx[1]->errors.size(), 1u);
      EXPECT_NE(rx[1]->errors[0].find("restart it"), std::string::npos) << rx[1]->errors[0];
      EXPECT_EQ(rx[1]->fleet->receiver().version(), 1u);
      rx[1] = start_receiver(store, c, 1, {.tp = 1, .tp_rank = 0});  // restarted: heals
      EXPECT_EQ(rx[1]->fleet->healed_version(), 3u) << rx[1]->fleet->heal_log();
      phase = 1;
    }
    while (phase.load() < 1) std::this_thread::yield();
    u = ps.update("a");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(u->members.size(), 2u);
  });
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(4));
    expect_matches_reference(t->fleet->receiver(), c, t->layout, a, 4);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// A receiver with no peer of its shard (TP rank 1 of the only engine) restarts. It heals from
// the servers' copy of the last version sent, by one-sided gets, converting the shards itself;
// or, when the servers refreshed that checkpoint since (`refreshed`: the copy is no longer that
// version), it joins fresh (version 0) and the next update brings it the whole next version.
// Its TP partner keeps its weights throughout; p2p and broadcast mode.
void restarted_receiver_without_peer(TransferMode mode, uint64_t first_version, bool refreshed,
                                     WeightFormat format = WeightFormat::kBF16) {
  SCOPED_TRACE(std::string(transfer_mode_name(mode)) + " from version " +
               std::to_string(first_version) + (refreshed ? ", refreshed" : ""));
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), a2 = random_weights(c, 3),
                           b = random_weights(c, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) {
    rx.push_back(start_receiver(store, c, i, {.tp = 2, .tp_rank = i, .format = format}));
  }
  std::atomic<int> phase{0};
  run_servers(store, mode, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
    for (uint64_t v = 1; v <= first_version; ++v) ASSERT_TRUE(ps.update("a").ok());
    if (refreshed) {
      ASSERT_TRUE(ps.refresh("a", a2).ok());
    }
    if (ps.options().rank == 0) {
      ASSERT_TRUE(rx[1]->wait_version(first_version));
      rx[1]->join();
      rx[1] = start_receiver(store, c, 1, {.tp = 2, .tp_rank = 1, .format = format});
      const std::string log = rx[1]->fleet->heal_log();
      if (refreshed) {
        EXPECT_EQ(rx[1]->fleet->healed_version(), 0u) << log;
        EXPECT_NE(log.find("changed its shards since it sent that version"), std::string::npos)
            << log;
      } else {
        EXPECT_EQ(rx[1]->fleet->healed_version(), first_version) << log;
        expect_matches_reference(rx[1]->fleet->receiver(), c, rx[1]->layout, a, first_version);
      }
      phase = 1;
    }
    while (phase.load() < 1) std::this_thread::yield();
    auto u = ps.update(refreshed ? "a" : "b");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(u->members.size(), 2u);
    EXPECT_TRUE(u->copy_published.ok()) << u->copy_published.to_string();
  });
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(first_version + 1));
    expect_matches_reference(t->fleet->receiver(), c, t->layout, refreshed ? a2 : b,
                             first_version + 1);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// Both parities: the healed or fresh receiver's next slot is the other one.
TEST(ParameterServer, AReceiverWithNoPeerHealsFromTheServersCopyP2p) {
  restarted_receiver_without_peer(TransferMode::kP2P, 1, false);
  restarted_receiver_without_peer(TransferMode::kP2P, 2, false, WeightFormat::kFP8);
}
TEST(ParameterServer, AReceiverWithNoPeerHealsFromTheServersCopyBroadcast) {
  restarted_receiver_without_peer(TransferMode::kBroadcast, 1, false);
}
TEST(ParameterServer, AfterARefreshAReceiverWithNoPeerRejoinsFreshP2p) {
  restarted_receiver_without_peer(TransferMode::kP2P, 1, true);
  restarted_receiver_without_peer(TransferMode::kP2P, 2, true);
}
TEST(ParameterServer, AfterARefreshAReceiverWithNoPeerRejoinsFreshBroadcast) {
  restarted_receiver_without_peer(TransferMode::kBroadcast, 1, true);
}

// Checkpoints from safetensors files, one checkpoint split across two files; a file that
// lacks a tensor is refused naming it.
// A safetensors file of `names` (F32) as a writer that does not pad its header may leave it:
// the data section starts off every F32 tensor's 4-byte alignment, so reading each one takes
// SafetensorsFile::get's aligned copy.
void write_misaligned(const std::string& path, const LayoutSpec& spec,
                      const std::map<std::string, std::vector<float>>& params,
                      const std::vector<std::string>& names) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const std::string& n : names) {
    const uint64_t bytes = params.at(n).size() * 4;
    header[n] = {
        {"dtype", "F32"}, {"shape", spec.params.at(n)}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 4 != 2) h += ' ';
  std::string out(8, '\0');
  const uint64_t len = h.size();
  std::memcpy(out.data(), &len, 8);
  out += h;
  for (const std::string& n : names) {
    out.append(reinterpret_cast<const char*>(params.at(n).data()), params.at(n).size() * 4);
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(out.data(), 1, out.size(), f), out.size());
  std::fclose(f);
}

// A Hugging Face style checkpoint of another model, split over two files whose tensors are all
// misaligned: registered by its layout spec, every receiver tensor equals the reference; a
// tensor no file holds, or two files hold, is refused naming it.
TEST(ParameterServer, RegistersALayoutSpecsCheckpointFromSafetensorsFiles) {
  const model::ModelConfig c = preset_or_die("tiny");
  const LayoutSpec spec = llama_hf_layout_spec(c, WeightFormat::kFP8);
  const auto a = testing::random_params(spec, 5);
  const std::string dir = ::testing::TempDir() + "/wl_ps_spec_files";
  std::filesystem::create_directories(dir);
  std::vector<std::string> first, second;
  for (const auto& [name, shape] : spec.params) {
    (name.find("model.layers.1.") == 0 ? second : first).push_back(name);
  }
  write_misaligned(dir + "/part1.safetensors", spec, a, first);
  write_misaligned(dir + "/part2.safetensors", spec, a, second);
  write_misaligned(dir + "/again.safetensors", spec, a, {first.front()});

  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int i = 0; i < 2; ++i) {
    const LayoutOptions o{.tp = 2, .tp_rank = i, .format = WeightFormat::kBF16};
    auto lay = spec_layout(spec_in_format(spec, o.format), o.tp, o.tp_rank);
    ASSERT_TRUE(lay.ok()) << lay.status().to_string();
    rx.push_back(start_receiver(store, *lay, i, o));
  }
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    Status s = ps.register_checkpoint("hf", spec, {dir + "/part1.safetensors"});
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
    EXPECT_NE(s.message().find("no file holds tensor '" + second.front() + "'"), std::string::npos)
        << s.to_string();
    s = ps.register_checkpoint(
        "hf", spec,
        {dir + "/part1.safetensors", dir + "/part2.safetensors", dir + "/again.safetensors"});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("'" + first.front() + "' is in both"), std::string::npos)
        << s.to_string();
    s = ps.register_checkpoint("hf", spec,
                               {dir + "/part1.safetensors", dir + "/part2.safetensors"});
    ASSERT_TRUE(s.ok()) << s.to_string();
    auto u = ps.update("hf", {}, {.checksums = true});
    ASSERT_TRUE(u.ok()) << u.status().to_string();
  });
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(1));
    testing::expect_holds(t->fleet->receiver(),
                          reference_llama_hf_tensors(c, t->layout, a, spec.params), t->layout, 1);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

TEST(ParameterServer, RegistersCheckpointsFromSafetensorsFiles) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 3);
  const model::ParamLayout layout(c);
  const std::string dir = ::testing::TempDir() + "/wl_ps_files";
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> first, second;
  for (const model::ParamInfo& p : layout.params()) {
    auto& half = p.name.find("layers.1.") == 0 ? second : first;
    half.emplace_back(
        p.name, Tensor::borrow(const_cast<float*>(a.data()) + p.offset, DType::kF32, p.shape));
  }
  ASSERT_TRUE(write_safetensors(dir + "/part1.safetensors", first, {}).ok());
  ASSERT_TRUE(write_safetensors(dir + "/part2.safetensors", second, {}).ok());

  auto store = std::make_shared<comm::MemoryStore>();
  auto rx = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    Status s = ps.register_checkpoint("files", c, {dir + "/part1.safetensors"});
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(s.message().find("layers.1."), std::string::npos) << s.to_string();
    s = ps.register_checkpoint("files", c,
                               {dir + "/part1.safetensors", dir + "/part2.safetensors"});
    ASSERT_TRUE(s.ok()) << s.to_string();
    auto u = ps.update("files", {}, {.checksums = true});
    ASSERT_TRUE(u.ok()) << u.status().to_string();
  });
  ASSERT_TRUE(rx->wait_version(1));
  expect_matches_reference(rx->fleet->receiver(), c, rx->layout, a, 1);
  rx->join();
  EXPECT_TRUE(rx->errors.empty()) << rx->errors.front();
}

// One server rank's copy of a checkpoint is truncated on its disk, so only the other holds
// it. An update of it fails on both at once, naming that rank, before any round is posted
// (the other does not wait out the timeout in a generation nobody completes), and the servers
// stay in step: the next update goes through on both.
TEST(ParameterServer, ACheckpointOneServerRankCouldNotLoadFailsOnAllAndTheyStayInStep) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 4);
  const model::ParamLayout layout(c);
  const std::string dir = ::testing::TempDir() + "/wl_ps_one_rank";
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> all;
  for (const model::ParamInfo& p : layout.params()) {
    all.emplace_back(p.name,
                     Tensor::borrow(const_cast<float*>(a.data()) + p.offset, DType::kF32, p.shape));
  }
  const std::string good = dir + "/good.safetensors", cut = dir + "/cut.safetensors";
  ASSERT_TRUE(write_safetensors(good, all, {}).ok());
  std::filesystem::copy_file(good, cut, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(cut, std::filesystem::file_size(good) / 2);

  auto store = std::make_shared<comm::MemoryStore>();
  auto rx = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    const int rank = ps.options().rank;
    const Status loaded = ps.register_checkpoint("a", c, {rank == 1 ? cut : good});
    ASSERT_EQ(loaded.ok(), rank == 0) << loaded.to_string();
    const auto started = comm::Clock::now();
    auto u = ps.update("a");
    ASSERT_FALSE(u.ok());
    EXPECT_LT(comm::Clock::now() - started, 5s) << "the servers' timeout is 20 s";
    const std::string said = u.status().message();
    if (rank == 1) {
      EXPECT_EQ(u.status().code(), StatusCode::kNotFound) << said;
      EXPECT_NE(said.find("server rank 1 holds no checkpoint 'a'"), std::string::npos) << said;
    } else {
      EXPECT_NE(said.find("failed on server rank 1"), std::string::npos) << said;
      ASSERT_TRUE(ps.unregister_checkpoint("a").ok());
    }
    ASSERT_TRUE(ps.register_checkpoint("a", c, {good}).ok());
    u = ps.update("a");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
  });
  ASSERT_TRUE(rx->wait_version(1)) << "the failed update posted no round";
  expect_matches_reference(rx->fleet->receiver(), c, rx->layout, a, 1);
  rx->join();
  EXPECT_TRUE(rx->errors.empty()) << rx->errors.front();
}

// Healing while the peer keeps taking updates: whatever version the copy lands on, it is
// exactly that version (a, b, a, ... by parity), never a mixture.
TEST(Heal, CopiesAConsistentVersionWhileThePeerIsUpdated) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  auto store = std::make_shared<comm::MemoryStore>();
  auto rx0 = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  std::atomic<bool> first{false};
  std::thread healer([&] {
    while (!first.load()) std::this_thread::yield();
    for (int i = 0; i < 5; ++i) {
      auto lay = inference_layout(c, {.tp = 1, .tp_rank = 0});
      auto w = comm::Worker::create({.name = "healer"});
      ASSERT_TRUE(w.ok());
      auto r = Receiver::create(**w, {.tensors = tensor_specs(*lay)});
      ASSERT_TRUE(r.ok());
      auto rec = store->get(FleetKeys{"fleet"}.peer(0), 1s);
      ASSERT_TRUE(rec.ok());
      auto peer = peer_record_from_json(comm::to_string(*rec), "peer 0");
      ASSERT_TRUE(peer.ok()) << peer.status().to_string();
      // A peer's whole slot is copied, padding too: the canary checks the status block.
      const testing::SlotCanary canary(**r, testing::SlotCanary::Writes::kWholeUnpublishedSlots);
      auto v = heal_from_peer(**w, **r, *peer, {.attempts = 50});
      canary.expect_untouched();
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      expect_matches_reference(**r, c, {.tp = 1, .tp_rank = 0}, *v % 2 ? a : b, *v);
    }
  });
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.register_checkpoint("b", c, b).ok());
    // A fixed count: every server rank must run the same updates.
    for (int v = 1; v <= 60; ++v) {
      auto u = ps.update(v % 2 ? "a" : "b");
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      first = true;
    }
  });
  healer.join();
  rx0->join();
}

// The servers' copy records, as a healer reads them from the store.
std::vector<ServerCopyRecord> server_copy_records(comm::Store& store) {
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

// The fleet's store, counting what server rank 0 asks of it for an update: rounds posted
// and the join counter read (a receiver reads it only when it starts).
class CountingStore final : public comm::Store {
 public:
  Status set(std::string_view key, std::span<const std::byte> value) override {
    if (key.starts_with("fleet/round/") && key.find("/ack/") == std::string_view::npos) ++posted;
    return inner_.set(key, value);
  }
  Result<comm::Bytes> get(std::string_view key, std::chrono::milliseconds timeout) override {
    return inner_.get(key, timeout);
  }
  Result<int64_t> add(std::string_view key, int64_t delta) override {
    if (key == "fleet/joins" && delta == 0) ++joins_read;
    return inner_.add(key, delta);
  }
  std::atomic<int> posted{0}, joins_read{0};

 private:
  comm::MemoryStore inner_;
};

// Only a generation's first update is a store round (protocol.h, replays): 70 updates of an
// unchanged generation post none after it, each goes over the generation's group, numbered,
// and a receiver that starts after them joins the next update (a store round again).
TEST(ParameterServer, AnUnchangedGenerationsUpdatesGoOverItsGroupNotTheStore) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1);
  auto store = std::make_shared<CountingStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  rx.push_back(start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0}));
  std::atomic<int> phase{0};
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    SetOnExit release{phase, 1};
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    auto first = ps.update("a");
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    EXPECT_EQ(first->replay, 0u);
    const int posted = store->posted.load();  // the form round and the first update
    for (uint64_t v = 2; v <= 70; ++v) {
      auto u = ps.update("a");
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      EXPECT_EQ(u->replay, v - 1);
      EXPECT_EQ(u->round, first->round) << "a replay names the store round it follows";
    }
    if (ps.options().rank == 0) {
      EXPECT_EQ(store->posted.load(), posted) << "an unchanged generation's update posted a round";
      auto last = last_round_posted(*store, FleetKeys{"fleet"});
      ASSERT_TRUE(last.ok()) << last.status().to_string();
      EXPECT_EQ(*last, first->round);
      ASSERT_TRUE(rx[0]->wait_version(70));
      rx.push_back(start_receiver(store, c, 1, {.tp = 1, .tp_rank = 0}));
      EXPECT_EQ(rx[1]->fleet->healed_version(), 70u) << rx[1]->fleet->heal_log();
    } else {
      while (phase.load() < 1) std::this_thread::yield();
    }
    phase = 1;
    auto u = ps.update("a");
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(u->members.size(), 2u);
    EXPECT_EQ(u->replay, 0u) << "a new generation's first update is a store round";
    EXPECT_EQ(u->generation, 2u);
  });
  for (auto& t : rx) {
    ASSERT_TRUE(t->wait_version(71));
    expect_matches_reference(t->fleet->receiver(), c, t->layout, a, 71);
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// An update that names the generation's members asks the store nothing: no round, no join
// record (one that takes everyone who joined reads the join counter, once). A member that
// leaves tells the servers over the group, so an update naming it still finds it gone, at
// once, instead of failing on it at the timeout.
TEST(ParameterServer, AnUpdateNamingItsMembersAsksTheStoreNothing) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1);
  auto store = std::make_shared<CountingStore>();
  std::vector<std::unique_ptr<ReceiverThread>> rx;
  for (int id : {0, 1}) rx.push_back(start_receiver(store, c, id, {.tp = 1, .tp_rank = 0}));
  std::atomic<int> phase{0};
  const int both[] = {0, 1}, first[] = {0};
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    SetOnExit release{phase, 1};
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.update("a", both).ok());
    const int posted = store->posted.load(), read = store->joins_read.load();
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(ps.update("a", both).ok());
    if (ps.options().rank == 0) {
      EXPECT_EQ(store->posted.load(), posted);
      EXPECT_EQ(store->joins_read.load(), read);
    }
    ASSERT_TRUE(ps.update("a").ok());
    if (ps.options().rank == 0) {
      EXPECT_EQ(store->posted.load(), posted);
      EXPECT_EQ(store->joins_read.load(), read + 1);
      ASSERT_TRUE(rx[0]->wait_version(12));
      ASSERT_TRUE(rx[1]->wait_version(12));
      ASSERT_TRUE(rx[1]->leave().ok());
    } else {
      while (phase.load() < 1) std::this_thread::yield();
    }
    phase = 1;
    const auto asked = comm::Clock::now();
    auto gone = ps.update("a", both);
    EXPECT_EQ(gone.status().code(), StatusCode::kNotFound) << gone.status().to_string();
    EXPECT_LT(comm::Clock::now() - asked, 5s) << "the update waited for the receiver that left";
    if (ps.options().rank == 0) {
      EXPECT_NE(gone.status().message().find("receiver 1 has not joined"), std::string::npos)
          << gone.status().to_string();
    }
    gone = ps.update("a", both);  // its notice was taken: the servers remember the leave
    EXPECT_EQ(gone.status().code(), StatusCode::kNotFound) << gone.status().to_string();
    EXPECT_LT(comm::Clock::now() - asked, 10s) << "the update waited for the receiver that left";
    auto u = ps.update("a", first);
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    EXPECT_EQ(u->members.size(), 1u);
  });
  ASSERT_TRUE(rx[0]->wait_version(13));
  expect_matches_reference(rx[0]->fleet->receiver(), c, rx[0]->layout, a, 13);
  EXPECT_EQ(rx[1]->fleet->receiver().version(), 12u);
  for (auto& t : rx) {
    t->join();
    EXPECT_TRUE(t->errors.empty()) << t->errors.front();
  }
}

// Waits (30 s at most) until every server rank has counted its first update into `published`.
bool all_servers_published(const std::atomic<int>& published) {
  const auto deadline = comm::deadline_after(30s);
  while (published.load() < kServers && comm::Clock::now() < deadline) {
    std::this_thread::yield();
  }
  return published.load() == kServers;
}

// Records that no heal may use: the wrong number, one from another checkpoint (an update under
// way), and one missing a shard, which is damage no retry mends (not a start-fresh case).
void expect_bad_records_refused(const model::ModelConfig& c,
                                const std::vector<ServerCopyRecord>& records) {
  Healer h(c);
  auto v = h.heal(std::span(records).first(1));
  EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status().to_string();
  std::vector<ServerCopyRecord> mixed = records;
  mixed[1].checkpoint = "b";
  v = h.heal(mixed);
  EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status().to_string();
  EXPECT_NE(v.status().message().find("server rank 1 last sent 'b'"), std::string::npos)
      << v.status().to_string();
  EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
  std::vector<ServerCopyRecord> damaged = records;
  damaged[1].shards.pop_back();
  v = h.heal(damaged);
  EXPECT_EQ(v.status().code(), StatusCode::kDataLoss) << v.status().to_string();
  EXPECT_NE(v.status().message().find("server 1's record names no shard"), std::string::npos)
      << v.status().to_string();
  EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
}

// Healing from the servers while they refresh the checkpoint and send it again and again: a
// heal either lands exactly the version its records name or is refused (the shards changed
// during the copy, or the records are mid-update); never a mixture. Records that disagree, or
// come in the wrong number, are refused before any get.
TEST(HealFromServers, CopiesExactlyTheVersionSentOrRefusesWhileTheServersRefresh) {
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1), a2 = random_weights(c, 3);
  auto store = std::make_shared<comm::MemoryStore>();
  auto rx = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  // phase 2: the healer is ready for the refreshes; 3: the healer is done (the servers keep
  // their copies until then).
  std::atomic<int> phase{0}, published{0}, refreshed{0};
  std::atomic<int> healed{0}, refused{0};
  std::thread healer([&] {
    SetOnExit release{phase, 3};
    ASSERT_TRUE(all_servers_published(published)) << "the servers' update did not complete";
    const std::vector<ServerCopyRecord> records = server_copy_records(*store);
    ASSERT_EQ(records[0].version, 1u);
    ASSERT_EQ(records[0].checkpoint, "a");
    {  // Before any refresh: exact, and in fp8 too (the healer quantizes itself).
      for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
        Healer h(c, {.tp = 2, .tp_rank = 1, .format = f});
        auto v = h.heal(records);
        ASSERT_TRUE(v.ok()) << v.status().to_string();
        EXPECT_EQ(*v, 1u);
        expect_matches_reference(*h.receiver, c, h.layout, a, 1);
      }
    }
    expect_bad_records_refused(c, records);
    // While the servers refresh and update in turn, each heal reads the latest records: it
    // lands exactly the version they name, or is refused (a refresh overlapped the copy, or
    // the records are mid-update). Once they stop, one more heal must land the last version.
    phase = 2;
    auto heal_latest = [&] {
      Healer h(c);
      auto v = h.heal(server_copy_records(*store));
      if (v.ok()) {
        ++healed;
        expect_matches_reference(*h.receiver, c, h.layout, *v % 2 ? a : a2, *v);
        return true;
      }
      ++refused;
      std::cerr << "[refused: " << v.status().message() << "]\n";
      EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status().to_string();
      EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
      return false;
    };
    while (refreshed.load() < kServers) heal_latest();
    EXPECT_TRUE(heal_latest()) << "healing once the servers are quiet";
  });
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.update("a").ok());  // publishes its copy record before it returns
    ++published;
    while (phase.load() < 2) std::this_thread::yield();
    // Version v holds a for odd v, a2 for even v.
    for (uint64_t v = 2; v <= 21; ++v) {
      ASSERT_TRUE(ps.refresh("a", v % 2 ? a : a2).ok());
      auto u = ps.update("a");
      ASSERT_TRUE(u.ok()) << u.status().to_string();
      ASSERT_EQ(u->report.version, v);
    }
    ++refreshed;
    while (phase.load() < 3) std::this_thread::yield();
    EXPECT_EQ(ps.refresh("nope", a).code(), StatusCode::kNotFound);
    EXPECT_EQ(ps.refresh("a", std::span(a).first(10)).code(), StatusCode::kInvalidArgument);
  });
  healer.join();
  std::cerr << "[heals during refreshes: " << healed.load() << " exact, " << refused.load()
            << " refused]\n";
  rx->join();
}

// Over TCP a one-sided get moves only while its target progresses its worker. Servers busy in
// a training step that never serves leave a heal to run into its deadline; servers that call
// serve_for() between steps let it land exactly the version they sent. The test's workers use
// UCX_TLS=tcp (set here, so it means the same under ctest and when run by hand).
TEST(HealFromServers, OverTcpAHealMovesOnlyWhileTheServersServe) {
  struct TcpOnly {
    std::optional<std::string> saved;
    TcpOnly() {
      if (const char* v = std::getenv("UCX_TLS")) saved = v;
      ::setenv("UCX_TLS", "tcp", 1);
    }
    ~TcpOnly() {
      saved ? (void)::setenv("UCX_TLS", saved->c_str(), 1) : (void)::unsetenv("UCX_TLS");
    }
  } tcp_only;
  const model::ModelConfig c = preset_or_die("tiny");
  const std::vector<float> a = random_weights(c, 1);
  auto store = std::make_shared<comm::MemoryStore>();
  auto rx = start_receiver(store, c, 0, {.tp = 1, .tp_rank = 0});
  // phase 1: the servers serve between steps; 2: the healer is done.
  std::atomic<int> published{0}, phase{0};
  std::thread healer([&] {
    SetOnExit release{phase, 2};
    ASSERT_TRUE(all_servers_published(published)) << "the servers' update did not complete";
    const std::vector<ServerCopyRecord> records = server_copy_records(*store);
    {
      Healer h(c);
      auto v = h.heal(records, {.timeout = 1500ms});
      EXPECT_EQ(v.status().code(), StatusCode::kDeadlineExceeded) << v.status().to_string();
      EXPECT_EQ(h.receiver->version(), 0u) << "nothing adopted";
    }
    phase = 1;
    Healer h(c);
    const auto start = comm::Clock::now();
    auto v = h.heal(records, {.timeout = 20s});
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    EXPECT_EQ(*v, 1u);
    expect_matches_reference(*h.receiver, c, h.layout, a, 1);
    std::cerr
        << "[healed over TCP in "
        << std::chrono::duration_cast<std::chrono::milliseconds>(comm::Clock::now() - start).count()
        << " ms while the servers served]\n";
  });
  run_servers(store, TransferMode::kP2P, [&](ParameterServer& ps) {
    ASSERT_TRUE(ps.register_checkpoint("a", c, a).ok());
    ASSERT_TRUE(ps.update("a").ok());  // publishes its copy record before it returns
    ++published;
    while (phase.load() < 1) std::this_thread::sleep_for(1ms);  // a step that never serves
    while (phase.load() < 2) {
      std::this_thread::sleep_for(5ms);  // a step
      ps.serve_for(5ms);
    }
  });
  healer.join();
  rx->join();
  EXPECT_TRUE(rx->errors.empty()) << rx->errors.front();
}

// Records as the store holds them: round trip, then what a damaged or foreign one gives.
TEST(HealFromServers, RecordsThatAreNotServerCopiesAreDataLoss) {
  ServerCopyRecord r{.rank = 1,
                     .servers = 2,
                     .checkpoint = "a",
                     .version = 3,
                     .stamp = 7,
                     .config = preset_or_die("tiny"),
                     .dtype = DType::kBF16,
                     .shards = {{"embed.weight", 0, 5, 64}},
                     .worker_address = {std::byte{1}, std::byte{2}},
                     .rkey = {std::byte{3}},
                     .region_address = 4096,
                     .region_bytes = 128,
                     .host = 9,
                     .pid = 42};
  auto back = server_copy_from_json(server_copy_to_json(r), "copy/1");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->checkpoint, "a");
  EXPECT_EQ(back->stamp, 7u);
  EXPECT_EQ(back->shards[0].end, 5);
  EXPECT_EQ(back->rkey, r.rkey);
  EXPECT_EQ(back->dtype, DType::kBF16);

  std::string text = server_copy_to_json(r);
  for (const std::string& bad : {text.substr(0, text.size() / 2),
                                 std::string("{\"format_version\": 2}"), std::string("[]")}) {
    auto got = server_copy_from_json(bad, "fleet/copy/1");
    EXPECT_EQ(got.status().code(), StatusCode::kDataLoss) << bad;
    EXPECT_NE(got.status().message().find("fleet/copy/1"), std::string::npos)
        << got.status().to_string();
  }
  // Version 2's records named the version themselves, over a two-word status block.
  auto v2 = server_copy_from_json(
      "{\"format\": \"weightlift-fleet-server-copy\", \"format_version\": 2}", "fleet/copy/1");
  EXPECT_EQ(v2.status().code(), StatusCode::kFailedPrecondition) << v2.status().to_string();
  EXPECT_NE(v2.status().message().find("format version 2, this build reads version 3; run one "
                                       "weightlift version across the fleet"),
            std::string::npos)
      << v2.status().to_string();
  r.rank = 2;  // not a rank of 2 servers
  EXPECT_EQ(server_copy_from_json(server_copy_to_json(r), "copy").status().code(),
            StatusCode::kDataLoss);
}

// A restarted receiver with no peer of its shard, as FleetReceiver::create meets the servers'
// copy records in the store: withdrawn ones (no version to heal) are a fresh start; a damaged
// one, or one whose checkpoint cannot produce this receiver's layout, fails the start naming
// what was wrong instead of starting it fresh.
TEST(HealFromServers, AReceiverStartsFreshOnlyWhenTheServersCopyIsNotThatVersion) {
  const model::ModelConfig c = preset_or_die("tiny");
  auto lay = inference_layout(c, {.tp = 1, .tp_rank = 0});
  ASSERT_TRUE(lay.ok()) << lay.status().to_string();
  auto start = [&](const std::string& record) {
    auto store = std::make_shared<comm::MemoryStore>();
    EXPECT_TRUE(store->set("fleet/copy/0", comm::to_bytes(record)).ok());
    return FleetReceiver::create(
        {.store = store, .id = 0, .receiver = {.tensors = tensor_specs(*lay)}, .timeout = 5s});
  };
  const comm::ProcessId self = comm::this_process();
  ServerCopyRecord r{.rank = 0,
                     .servers = 1,
                     .checkpoint = "a",
                     .version = 0,
                     .config = c,
                     .dtype = DType::kBF16,
                     .host = self.host,
                     .pid = self.pid};

  auto withdrawn = start(server_copy_to_json(r));
  ASSERT_TRUE(withdrawn.ok()) << withdrawn.status().to_string();
  EXPECT_EQ((*withdrawn)->healed_version(), 0u);
  EXPECT_NE((*withdrawn)->heal_log().find("nothing to heal from"), std::string::npos)
      << (*withdrawn)->heal_log();

  r.version = 3;
  const std::string text = server_copy_to_json(r);
  auto damaged = start(text.substr(0, text.size() / 2));
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss) << damaged.status().to_string();
  EXPECT_NE(damaged.status().message().find("fleet/copy/0"), std::string::npos)
      << damaged.status().to_string();

  r.config = preset_or_die("small");  // not the model this receiver serves
  auto other_model = start(server_copy_to_json(r));
  EXPECT_EQ(other_model.status().code(), StatusCode::kInvalidArgument)
      << other_model.status().to_string();
  EXPECT_NE(other_model.status().message().find("healing at start: receiver rank 0: tensor "
                                                "'embed.weight' is BF16 [320, 64]"),
            std::string::npos)
      << other_model.status().to_string();
}

}  // namespace
}  // namespace wl::transfer
