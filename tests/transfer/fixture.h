// Shared by the transfer tests: random trainer weights with varied magnitudes, paper ranks
// for layouts known to be valid (planner tests; the builders are plan/offline_metadata.h), and a
// world of thread-ranks split into trainer meshes and receivers (update tests).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/comm/transport/fault_transport.h"
#include "weightlift/core/random.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/layout_spec.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "weightlift/transfer/layout/trainer_weights.h"
#include "weightlift/transfer/modes/update_executor.h"
#include "weightlift/transfer/plan/metadata.h"
#include "weightlift/transfer/plan/offline_metadata.h"
#include "weightlift/transfer/plan/plan_transfer.h"

namespace wl::transfer::testing {

// A preset, or "tiny-qwen3-moe": tiny with Qwen3-MoE's q/k norms and a dense first layer.
inline model::ModelConfig preset_or_die(const char* name) {
  if (std::string_view(name) == "tiny-qwen3-moe") {
    model::ModelConfig c = preset_or_die("tiny");
    c.qk_norm = true;
    c.dense_layers = {0};
    c.dense_ffn_dim = 96;
    return c;
  }
  auto c = model::preset(name);
  WL_CHECK(c.ok()) << c.status().to_string();
  return *c;
}

// Every parameter, f32, ParamLayout order. Rows get magnitudes 2^-6 .. 2^2 so that fp8 block
// scales differ between blocks; expert 1 of layer 0 has an all-zero down_proj (the scale-1
// rule for empty blocks).
inline std::vector<float> random_weights(const model::ModelConfig& c, uint64_t seed) {
  const model::ParamLayout layout(c);
  std::vector<float> w(size_t(layout.total()));
  Rng rng(seed);
  for (const model::ParamInfo& p : layout.params()) {
    const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
    const bool zero = p.name == "layers.0.moe.experts.1.down_proj.weight";
    for (int64_t i = 0; i < p.numel(); ++i) {
      const float mag = std::ldexp(1.0f, int((i / cols) % 9) - 6);
      w[size_t(p.offset + i)] = zero ? 0.0f : (2.0f * rng.uniform() - 1.0f) * mag;
    }
  }
  return w;
}

// Another model's weights, every parameter of `spec` by name, with row magnitudes 2^-6 .. 2^2
// (fp8 block scales differ) and values by `seed`.
inline std::map<std::string, std::vector<float>> random_params(const LayoutSpec& spec,
                                                               uint64_t seed) {
  std::map<std::string, std::vector<float>> out;
  Rng rng(seed);
  for (const auto& [name, shape] : spec.params) {
    const int64_t cols = shape.size() == 2 ? shape[1] : 1;
    std::vector<float>& v = out[name];
    v.resize(size_t(shape_numel(shape)));
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = (2.0f * rng.uniform() - 1.0f) * std::ldexp(1.0f, int((int64_t(i) / cols) % 9) - 6);
    }
  }
  return out;
}

inline std::vector<NamedTensor> named(const LayoutSpec& spec,
                                      const std::map<std::string, std::vector<float>>& params) {
  std::vector<NamedTensor> out;
  for (const auto& [name, v] : params) {
    out.push_back({name, DType::kF32, spec.params.at(name), v.data()});
  }
  return out;
}

// What shards of `dtype` hold, widened back to f32: the reference transform's input.
inline std::vector<float> as_held(std::vector<float> w, DType dtype) {
  if (dtype == DType::kBF16) round_through(DType::kBF16, w.data(), w.data(), w.size());
  return w;
}

// The library's paper_receiver (plan/offline_metadata.h) for a layout the test knows is valid.
inline RankMeta paper_receiver_or_die(const model::ModelConfig& c, int rank,
                                      const LayoutOptions& o) {
  auto m = paper_receiver(c, rank, o);
  WL_CHECK(m.ok()) << m.status().to_string();
  return *std::move(m);
}

// A world of `size` thread-ranks, each with its own UCX worker; fn(rank, world) on each, then
// a barrier so no rank tears down its worker while another still writes to it. With `faults`
// each rank's worker is wrapped in a FaultTransport (comm/transport/fault_transport.h), which a
// test reaches as dynamic_cast<comm::FaultTransport&>(world->worker()) to arm its faults. What fn
// returns is let go only after the rank has let go of its group: memory that writes may still
// reach must outlive the worker (see Rank).
inline void run_world_keeping(
    int size, const std::function<std::shared_ptr<void>(int, std::shared_ptr<comm::Group>)>& fn,
    bool faults = false) {
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      std::shared_ptr<void> keep;  // declared first: goes after the group
      std::shared_ptr<comm::Transport> transport;
      if (faults) {
        auto t = comm::FaultTransport::create({.name = "rank " + std::to_string(r)});
        ASSERT_TRUE(t.ok()) << t.status().to_string();
        transport = std::move(*t);
      }
      {
        auto g = comm::Group::connect({.store = store,
                                       .rank = r,
                                       .size = size,
                                       .timeout = std::chrono::seconds(20),
                                       .transport = std::move(transport),
                                       .ids_key = faults ? "ids" : ""});
        ASSERT_TRUE(g.ok()) << g.status().to_string();
        keep = fn(r, *g);
        Status s = comm::barrier(**g);
        EXPECT_TRUE(s.ok()) << s.to_string();
      }
      keep.reset();  // the group's last holder, if it holds one; then what it kept alive
    });
  }
  for (auto& t : threads) t.join();
}

inline void run_world(int size, const std::function<void(int, std::shared_ptr<comm::Group>)>& fn,
                      bool faults = false) {
  run_world_keeping(
      size,
      [&](int r, std::shared_ptr<comm::Group> g) {
        fn(r, std::move(g));
        return std::shared_ptr<void>();
      },
      faults);
}

// ---- update tests: a world of trainers and receivers ---------------------------------------

struct Case {
  const char* preset = "tiny";
  int meshes = 1, mesh_size = 1;  // trainers: meshes * mesh_size, world ranks first
  int tp = 1, engines = 1;        // receivers: engines * tp * ep, world ranks after the trainers
  int ep = 1;                     // engine rank r: TP rank r % tp of EP rank r / tp
  WeightFormat format = WeightFormat::kBF16;
  DType shard_dtype = DType::kF32;
  bool offload = false;
  bool faults = false;  // every rank's group over a FaultTransport (run_world)
  // Each mesh rank holds whole layers, as a pipeline stage does (stage_splits), instead of
  // torch.chunk's rows of every parameter.
  bool stages = false;
  std::string name() const {
    return std::string(preset) + " " + std::to_string(meshes) + "x" + std::to_string(mesh_size) +
           " trainers, " + std::to_string(engines) + "x tp" + std::to_string(tp) +
           (ep > 1 ? " ep" + std::to_string(ep) : std::string()) + " " +
           std::string(weight_format_name(format)) + ", shards " +
           std::string(dtype_name(shard_dtype)) + (offload ? " offloaded" : "") +
           (stages ? " by stages" : "");
  }
  int trainers() const { return meshes * mesh_size; }
  int size() const { return trainers() + engines * tp * ep; }
};

// One rank's role in a Case: its mesh (trainers) or its receiver, ready to plan.
// Declared so that the receiver goes last, after the world (and with it, once nothing else
// holds it, the worker): over TCP a put its sender gave up on may still sit in the worker's
// socket and is applied whenever the worker next progresses, even while it closes.
struct Rank {
  std::unique_ptr<Receiver> receiver;
  std::shared_ptr<comm::Group> world;
  std::unique_ptr<TrainerWeights> weights;
  LayoutOptions layout;
  RankMeta meta;
};

// Splits of every parameter of `c` over `stages` ranks as pipeline stages hold them: layer l
// whole on stage l * stages / num_layers, the embedding on the first, the rest on the last.
inline std::vector<RowSplit> stage_splits(const model::ModelConfig& c, int stages) {
  std::vector<RowSplit> out;
  const model::ParamLayout layout(c);
  for (const model::ParamInfo& p : layout.params()) {
    int owner = stages - 1;
    if (p.name.starts_with("embed")) owner = 0;
    if (p.name.starts_with("layers.")) {
      owner = int(std::stoll(p.name.substr(7)) * stages / c.num_layers);
    }
    std::vector<ShardRows> per_rank;
    for (int k = 0; k < stages; ++k) {
      per_rank.push_back({k <= owner ? 0 : p.shape[0], k < owner ? 0 : p.shape[0]});
    }
    auto split = RowSplit::of(per_rank, p.shape[0], p.name);
    WL_CHECK(split.ok()) << split.status().to_string();
    out.push_back(*std::move(split));
  }
  return out;
}

inline Rank join(const Case& k, int rank, std::shared_ptr<comm::Group> world,
                 std::span<const float> weights) {
  Rank r;
  r.world = world;
  const model::ModelConfig c = preset_or_die(k.preset);
  const bool trainer = rank < k.trainers();
  auto mesh = world->split({.color = trainer ? rank / k.mesh_size : comm::kNoColor, .key = rank});
  WL_CHECK(mesh.ok()) << mesh.status().to_string();
  if (trainer) {
    r.weights = std::make_unique<TrainerWeights>(TrainerWeights::from_full(
        c, weights, *mesh,
        {.dtype = k.shard_dtype,
         .offload = k.offload,
         .mesh_id = rank / k.mesh_size,
         .splits = k.stages ? stage_splits(c, k.mesh_size) : std::vector<RowSplit>{}}));
    r.meta = describe_trainer(rank, *r.weights);
  } else {
    const int i = rank - k.trainers(), engine = k.tp * k.ep;
    r.layout = {.tp = k.tp,
                .tp_rank = i % k.tp,
                .ep = k.ep,
                .ep_rank = i % engine / k.tp,
                .format = k.format};
    auto lay = inference_layout(c, r.layout);
    WL_CHECK(lay.ok()) << lay.status().to_string();
    auto rc = Receiver::create(world->worker(), {.tensors = tensor_specs(*lay),
                                                 .engine = i / engine,
                                                 .tp = k.tp,
                                                 .tp_rank = i % k.tp,
                                                 .ep = k.ep,
                                                 .ep_rank = r.layout.ep_rank,
                                                 .format = k.format});
    WL_CHECK(rc.ok()) << rc.status().to_string();
    r.receiver = std::move(*rc);
    r.meta = describe_receiver(rank, *r.receiver);
  }
  return r;
}

// Every rank of case k as a thread: joined with full weights `w`, the transfer planned from
// every rank's metadata; then fn on each.
inline void run_planned(const Case& k, std::span<const float> w,
                        const std::function<void(int, Rank&, const Plan&)>& fn) {
  run_world_keeping(
      k.size(),
      [&](int rank, std::shared_ptr<comm::Group> world) {
        auto r = std::make_shared<Rank>(join(k, rank, world, w));
        auto plan = plan_transfer(*world, r->meta);
        EXPECT_TRUE(plan.ok()) << plan.status().to_string();
        if (plan.ok()) fn(rank, *r, *plan);
        return std::shared_ptr<void>(std::move(r));
      },
      k.faults);
}

// This rank's executor of `plan` in `mode`; collective over the world, as the library's is.
inline Result<std::unique_ptr<UpdateExecutor>> make_executor(Rank& r, const Plan& plan,
                                                             TransferMode mode = TransferMode::kP2P,
                                                             size_t bucket_bytes = size_t(64)
                                                                                   << 20) {
  return make_update_executor({.world = r.world,
                               .plan = plan,
                               .weights = r.weights.get(),
                               .receiver = r.receiver.get(),
                               .mode = mode,
                               .bucket_bytes = bucket_bytes});
}

// Every tensor the receiver holds equals `ref`, byte for byte, at `version`.
inline void expect_holds(const Receiver& receiver,
                         const std::map<std::string, ReferenceTensor>& ref,
                         const LayoutOptions& layout, uint64_t version) {
  Receiver::ReadGuard g = receiver.acquire();
  EXPECT_EQ(g.version(), version);
  ASSERT_EQ(receiver.entries().size(), ref.size());
  for (const ReceiverEntry& e : receiver.entries()) {
    const ReferenceTensor& want = ref.at(e.spec.name);
    const Tensor got = g.tensor(e.spec.name);
    ASSERT_EQ(got.nbytes(), want.bytes.size()) << e.spec.name;
    const auto* p = static_cast<const std::byte*>(got.raw());
    const auto diff = std::mismatch(p, p + want.bytes.size(), want.bytes.begin());
    EXPECT_EQ(diff.first, p + want.bytes.size())
        << e.spec.name << " (" << describe_rank(layout) << "): first differing byte "
        << (diff.first - p) << " of " << want.bytes.size();
  }
}

// The same against the reference transform of our model's weights.
inline void expect_matches_reference(const Receiver& receiver, const model::ModelConfig& c,
                                     const LayoutOptions& layout, std::span<const float> held,
                                     uint64_t version) {
  expect_holds(receiver, reference_receiver_tensors(c, layout, held), layout, version);
}

// No tensor byte of `slot` was ever written (the padding between tensors is the canaries'
// business, below).
inline bool slot_is_zero(const Receiver& r, int slot) {
  const std::span<std::byte> mem = r.slot(slot);
  for (const ReceiverEntry& e : r.entries()) {
    for (size_t i = e.offset; i < e.offset + e.bytes; ++i) {
      if (mem[i] != std::byte{0}) return false;
    }
  }
  return true;
}

// ---- canaries: one-sided writes that stray ---------------------------------------------------
//
// A receiver's memory is [slot 0 | slot 1 | status] (layout/receiver.h). An update from version
// v writes version v + 1 into slot (v + 1) % 2, and only the tensors' bytes there. Armed before
// an update (on the receiver's thread, before it joins: no writer can run yet), SlotCanary
// fills every byte no write may touch with a pattern, or copies it where it holds data, and
// expect_untouched() checks them after the update, whether it succeeded or failed:
//   - the padding between tensors and after the last one, in the slot written (a fresh
//     receiver, version 0, may be given any version: then in both slots);
//   - all of the other slot: version v, which readers are using;
//   - the status block past its two words, and those words: the published version and 0,
//     or after a failed update possibly the version that was being written.
// A failure names the slot, the offset and the tensor the stray byte follows.
class SlotCanary {
 public:
  // What the write under test may touch. An update writes one slot's tensors. A heal from a
  // peer copies the peer's whole slot, padding included, and when the peer moves on during
  // the copy it retries into the other unpublished slot: of a receiver healed that way only
  // the published slot (none, at version 0) and the status block can be checked.
  enum class Writes { kOneSlot, kWholeUnpublishedSlots };

  explicit SlotCanary(const Receiver& r, Writes writes = Writes::kOneSlot)
      : r_(r), version_(r.version()), writes_(writes) {
    for (int slot : {0, 1}) {
      if (!published(slot)) {
        for_each_gap(slot, [&](size_t i) { r.slot(slot)[i] = pattern(slot, i); });
      }
      // The published version (readers use it); a fresh receiver's slots, one of which the
      // update will leave alone.
      if (published(slot) || version_ == 0) {
        const std::span<std::byte> mem = r.slot(slot);
        copies_[size_t(slot)].assign(mem.begin(), mem.end());
      }
    }
    const std::span<std::byte> status = r.status_block();
    for (size_t i = kStatusWords; i < status.size(); ++i) status[i] = pattern(2, i);
  }

  // What strayed, one line per finding; empty if nothing did.
  std::string violations() const {
    std::string out;
    const uint64_t now = r_.version();
    for (int slot : {0, 1}) {
      if (published(slot)) {
        out += copy_changed(slot);
        continue;
      }
      if (writes_ == Writes::kWholeUnpublishedSlots) continue;
      if (version_ == 0 && now > 0 && slot != int(now % 2)) {
        out += copy_changed(slot);
        continue;
      }
      size_t strays = 0, first = 0;
      for_each_gap(slot, [&](size_t i) {
        if (r_.slot(slot)[i] != pattern(slot, i) && strays++ == 0) first = i;
      });
      if (strays > 0) {
        out += std::to_string(strays) + " padding byte(s) of slot " + std::to_string(slot) +
               " written, the first at " + std::to_string(first) + ", after " + owner(first) + "\n";
      }
    }
    const std::span<std::byte> status = r_.status_block();
    for (size_t i = kStatusWords; i < status.size(); ++i) {
      if (status[i] != pattern(2, i))
        out += "status block byte " + std::to_string(i) + " written\n";
    }
    uint64_t words[2];
    std::memcpy(words, status.data(), sizeof words);
    if (words[0] != now || (words[1] != 0 && words[1] != now + 1)) {
      out += "status words (" + std::to_string(words[0]) + ", " + std::to_string(words[1]) +
             ") at version " + std::to_string(now) + "\n";
    }
    return out;
  }

  void expect_untouched() const {
    EXPECT_EQ(violations(), "") << "after an update from version " << version_;
  }

 private:
  static constexpr size_t kStatusWords = 16;  // bytes: [0] published, [1] being written

  bool published(int slot) const { return version_ > 0 && slot == int(version_ % 2); }

  // A pattern unlikely in weights and different at every offset, so a shifted write shows.
  static std::byte pattern(int where, size_t i) {
    return std::byte(uint8_t(0xA5 ^ (i * 0x3B) ^ (size_t(where) << 6)));
  }

  // fn(i) for every byte of `slot` outside every tensor.
  template <typename Fn>
  void for_each_gap(int slot, Fn fn) const {
    size_t at = 0;
    for (const ReceiverEntry& e : r_.entries()) {
      for (; at < e.offset; ++at) fn(at);
      at = e.offset + e.bytes;
    }
    for (; at < r_.slot(slot).size(); ++at) fn(at);
  }

  std::string owner(size_t offset) const {
    std::string name = "the slot's start";
    for (const ReceiverEntry& e : r_.entries()) {
      if (e.offset <= offset) name = "tensor '" + e.spec.name + "'";
    }
    return name;
  }

  std::string copy_changed(int slot) const {
    const std::span<std::byte> mem = r_.slot(slot);
    const auto diff = std::mismatch(mem.begin(), mem.end(), copies_[size_t(slot)].begin());
    if (diff.first == mem.end()) return "";
    const size_t at = size_t(diff.first - mem.begin());
    return "slot " + std::to_string(slot) + ", which the update had no business writing " +
           "(receiver at version " + std::to_string(version_) + " before it), changed at byte " +
           std::to_string(at) + ", in or after " + owner(at) + "\n";
  }

  const Receiver& r_;
  const uint64_t version_;
  const Writes writes_;
  std::array<std::vector<std::byte>, 2> copies_;  // slots that must not change, as they were
};

// This rank's part of an update; on a receiver with a SlotCanary armed before it and checked
// after it, whatever the outcome.
inline Result<UpdateReport> guarded_update(UpdateExecutor& ex, const Rank& r,
                                           const UpdateOptions& o) {
  if (r.receiver == nullptr) return ex.update(o);
  SlotCanary canary(*r.receiver);
  Result<UpdateReport> rep = ex.update(o);
  canary.expect_untouched();
  return rep;
}

}  // namespace wl::transfer::testing
