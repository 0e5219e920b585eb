// Shared by the transfer tests: random trainer weights with varied magnitudes, metadata for
// ranks that exist only on paper (planner tests), and a world of thread-ranks split into
// trainer meshes and receivers (update tests).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "weightlift/comm/barrier.h"
#include "weightlift/comm/memory_store.h"
#include "weightlift/core/random.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/metadata.h"

namespace wl::transfer::testing {

inline model::ModelConfig preset_or_die(const char* name) {
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

// What shards of `dtype` hold, widened back to f32: the reference transform's input.
inline std::vector<float> as_held(std::vector<float> w, DType dtype) {
  if (dtype == DType::kBF16) round_through(DType::kBF16, w.data(), w.data(), w.size());
  return w;
}

inline RankMeta paper_trainer(const model::ModelConfig& c, int rank, int mesh_id, int mesh_rank,
                              int mesh_size, DType dtype = DType::kF32) {
  RankMeta m{.rank = rank, .role = Role::kTrainer};
  m.config_json = model::config_to_json(c);
  m.mesh_id = mesh_id;
  m.mesh_rank = mesh_rank;
  m.mesh_size = mesh_size;
  const model::ParamLayout layout(c);
  for (const model::ParamInfo& p : layout.params()) {
    const ShardRows r = shard_rows(p.shape[0], mesh_size, mesh_rank);
    m.params.push_back({p.name, p.shape, dtype, r.begin, r.end, false});
  }
  return m;
}

inline RankMeta paper_receiver(int rank, const std::vector<ReceiverTensorSpec>& specs,
                               const LayoutOptions& o) {
  RankMeta m{.rank = rank, .role = Role::kReceiver};
  m.tp = o.tp;
  m.tp_rank = o.tp_rank;
  m.format = o.format;
  m.epoch = 1000 + uint64_t(rank);
  m.worker_address = {std::byte{1}, std::byte{2}};
  m.rkey = {std::byte{3}};
  size_t slot_bytes = 0;
  for (const ReceiverEntry& e : pack_receiver_tensors(specs, &slot_bytes)) {
    m.tensors.push_back({e.spec.name, e.spec.dtype, e.spec.shape, e.offset, e.bytes});
  }
  m.slot_bytes = slot_bytes;
  m.slot_address[0] = 1 << 20;
  m.slot_address[1] = (1 << 20) + slot_bytes;
  return m;
}

inline RankMeta paper_receiver(const model::ModelConfig& c, int rank, const LayoutOptions& o) {
  auto lay = inference_layout(c, o);
  WL_CHECK(lay.ok()) << lay.status().to_string();
  return paper_receiver(rank, tensor_specs(*lay), o);
}

// A world of `size` thread-ranks, each with its own UCX worker; fn(rank, world) on each, then
// a barrier so no rank tears down its worker while another still writes to it.
inline void run_world(int size, const std::function<void(int, std::shared_ptr<comm::Group>)>& fn) {
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto g = comm::Group::connect({.store = store, .rank = r, .size = size,
                                     .timeout = std::chrono::seconds(20)});
      ASSERT_TRUE(g.ok()) << g.status().to_string();
      fn(r, *g);
      Status s = comm::barrier(**g);
      EXPECT_TRUE(s.ok()) << s.to_string();
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace wl::transfer::testing
