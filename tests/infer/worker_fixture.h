// What the inference worker's tests share (worker_test.cc, batching_test.cc): test weights at
// a trained model's scale, fixed prompts, the engine's groups out of a world of thread-ranks.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../transfer/fixture.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/random.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::infer::testing {

using transfer::LayoutOptions;

// Ranks here are threads on a 2-core machine that other jobs share: each computes on one core
// (as one process per core would), since OpenMP teams of two per rank would oversubscribe the
// cores and spin at every barrier for a descheduled member (measured: 3 s became 90 s under a
// parallel build). The numbers do not depend on it beyond f32 reassociation.
class ComputeThreads {
 public:
  explicit ComputeThreads(int n) { set_num_threads(n); }
  ~ComputeThreads() { set_num_threads(saved_); }
  ComputeThreads(const ComputeThreads&) = delete;
  ComputeThreads& operator=(const ComputeThreads&) = delete;

 private:
  int saved_ = num_threads();
};

class OneComputeThread : public ComputeThreads {
 public:
  OneComputeThread() : ComputeThreads(1) {}
};

// Same effective weights, f32 sums in another order: measured at most 1.4e-6 S; 1e-4 S leaves
// room for other GEMM kernels and thread counts.
constexpr double kReassociation = 1e-4;

inline model::ModelConfig config_named(const std::string& name) {
  if (name == "small-2") {  // the `small` preset's widths with 2 layers, for speed
    model::ModelConfig c = transfer::testing::preset_or_die("small");
    c.num_layers = 2;
    return c;
  }
  if (name == "tiny-qwen3-moe" || name == "tiny-llama") {  // Hugging Face families' shapes
    model::ModelConfig c = transfer::testing::preset_or_die("tiny");
    c.num_layers = 3;
    c.num_kv_heads = 2;
    const bool qwen = name == "tiny-qwen3-moe";
    c.qk_norm = qwen;
    c.norm_topk = !qwen;
    c.dense_layers = qwen ? std::vector<int64_t>{1} : std::vector<int64_t>{0, 1, 2};
    c.dense_ffn_dim = 192;
    if (!qwen) c.num_experts = c.top_k = c.ffn_dim = 0;
    return c;
  }
  return transfer::testing::preset_or_die(name.c_str());
}

// Weights at a trained model's scale: every matrix N(0, 1/in) so activations stay O(1) through
// the blocks, rows at three magnitudes (x0.5, x1, x2) so rows inside one fp8 block differ and
// the small ones lose relative precision, norm gains 1 +- 0.1, and a head 4x larger so the
// logits spread over about +-10 and greedy decoding is decisive (top-2 margins of order 1).
inline std::vector<float> test_weights(const model::ModelConfig& c, uint64_t seed) {
  const model::ParamLayout layout(c);
  std::vector<float> w(size_t(layout.total()));
  Rng rng(seed);
  for (const model::ParamInfo& p : layout.params()) {
    float* dst = w.data() + p.offset;
    if (p.shape.size() == 1) {
      for (int64_t i = 0; i < p.numel(); ++i) dst[i] = 1.0f + 0.1f * rng.normal();
      continue;
    }
    const int64_t cols = p.shape[1];
    const bool embed = p.name == "embed.weight", head = p.name == "lm_head.weight";
    const bool router = p.name.ends_with("router.weight");
    const float base = embed ? 1.0f : (head ? 4.0f : router ? 4.0f : 1.0f) / std::sqrt(float(cols));
    for (int64_t i = 0; i < p.numel(); ++i) {
      const float row_mag = std::ldexp(1.0f, int((i / cols / 32) % 3) - 1);
      dst[i] = base * row_mag * rng.normal();
    }
  }
  return w;
}

inline std::vector<int64_t> bytes_of(const std::string& s) {
  return std::vector<int64_t>(s.begin(), s.end());
}

inline const std::vector<std::vector<int64_t>>& prompts() {
  static const std::vector<std::vector<int64_t>> p{bytes_of("The quick brown fox"),
                                                   bytes_of("weights"), bytes_of("x"),
                                                   bytes_of("Seed 000 moves a 1T model in 1.3 s")};
  return p;
}

// The TP group of this rank's EP rank and the EP group of its TP rank, carved out of the world
// of an engine's ranks (none without a world).
inline std::pair<std::shared_ptr<comm::Group>, std::shared_ptr<comm::Group>> engine_groups(
    const std::shared_ptr<comm::Group>& world, const LayoutOptions& layout) {
  if (!world) return {};
  auto tp = world->split({.color = layout.ep_rank, .key = layout.tp_rank});
  auto ep = world->split({.color = layout.tp_rank, .key = layout.ep_rank});
  WL_CHECK(tp.ok() && ep.ok()) << "splitting the engine's world";
  return {*tp, *ep};
}

// The largest |a - b| over two logit lists, and the largest |a|.
struct LogitGap {
  double gap = 0, scale = 0;
  void add(const float* a, const float* b, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      gap = std::max(gap, double(std::fabs(a[i] - b[i])));
      scale = std::max(scale, double(std::fabs(b[i])));
    }
  }
};

}  // namespace wl::infer::testing
