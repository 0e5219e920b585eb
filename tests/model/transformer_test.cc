// Model-level properties that need no outside reference (PyTorch comparisons live in
// tests/reference/): checkpointing changes memory, not numbers; gradients match finite
// differences; loading refuses weights that do not fit the config.
#include "weightlift/model/transformer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "support/scratch_dir.h"
#include "weightlift/core/random.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/units.h"

namespace wl::model {
namespace {

ModelConfig tiny() { return *preset("tiny"); }

struct Batch {
  int64_t b, t;
  std::vector<int64_t> tokens, targets;
};

Batch random_batch(const ModelConfig& c, int64_t b, int64_t t, uint64_t seed) {
  Rng rng(seed);
  Batch x{b, t, {}, {}};
  for (int64_t i = 0; i < b * t; ++i) {
    x.tokens.push_back(int64_t(rng.below(uint64_t(c.vocab_size))));
    x.targets.push_back(i % 7 == 3 ? -100 : int64_t(rng.below(uint64_t(c.vocab_size))));
  }
  return x;
}

TEST(Transformer, CheckpointingGivesIdenticalGradients) {
  ModelConfig c = tiny();
  c.z_loss_beta = 1e-3;
  Transformer a(c), b(c);
  a.init(3);
  b.init(3);
  Batch x = random_batch(c, 2, 32, 1);
  LossTerms la = a.forward_backward(x.tokens.data(), x.targets.data(), x.b, x.t, {});
  LossTerms lb =
      b.forward_backward(x.tokens.data(), x.targets.data(), x.b, x.t, {.checkpointing = true});
  EXPECT_EQ(la.loss(), lb.loss());
  // Recomputation runs the same deterministic kernels on the same inputs: bit-identical.
  const float* ga = a.grads().data<float>();
  const float* gb = b.grads().data<float>();
  for (int64_t i = 0; i < a.layout().total(); ++i) ASSERT_EQ(ga[i], gb[i]) << "element " << i;
}

TEST(Transformer, CheckpointingCutsActivationMemoryOfTwelveLayers) {
  ModelConfig c = tiny();
  c.num_layers = 12;
  Transformer m(c);
  m.init(1);
  Batch x = random_batch(c, 4, 128, 2);
  int64_t peak[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    const int64_t base = tensor_memory_stats().live_bytes;
    reset_tensor_memory_peak();
    m.forward_backward(x.tokens.data(), x.targets.data(), x.b, x.t, {.checkpointing = ckpt == 1});
    peak[ckpt] = tensor_memory_stats().peak_bytes - base;
  }
  std::printf(
      "12-layer tiny, batch 4 x 128: peak activation memory %.1f MB without "
      "checkpointing, %.1f MB with (%.1fx less)\n",
      peak[0] / 1e6, peak[1] / 1e6, double(peak[0]) / double(peak[1]));
  EXPECT_GE(double(peak[0]) / double(peak[1]), 3.0);
}

// activation_bytes() is what a pass really holds between its forward and its backward, to the
// byte: for every kind of pipeline stage, with and without checkpointing, on a model whose
// sizes are not multiples of 64 bytes.
TEST(StagePass, HoldsWhatActivationBytesSays) {
  ModelConfig c = tiny();
  c.num_layers = 3;
  c.num_experts = 5;
  c.top_k = 3;
  c.ffn_dim = 72;
  c.vocab_size = 301;
  Transformer m(c);
  m.init(4);
  const Batch x = random_batch(c, 3, 17, 5);
  const int head = c.num_layers + 1;
  for (const Stage stage : {Stage{0, head}, Stage{0, 2}, Stage{2, 3}, Stage{3, head}}) {
    for (bool checkpointing : {false, true}) {
      const PassModel pm = m.pass_model();
      StagePass pass(pm, stage, x.tokens.data(), x.b, x.t, {.checkpointing = checkpointing},
                     nullptr);
      std::vector<float> input(size_t(x.b * x.t * c.hidden_size), 0.5f);
      const int64_t before = tensor_memory_stats().live_bytes;
      ASSERT_TRUE(pass.forward(input.data(), true).ok());
      const int64_t held = tensor_memory_stats().live_bytes - before;
      EXPECT_EQ(uint64_t(held), activation_bytes(c, stage, x.b, x.t, checkpointing))
          << "stage [" << stage.first << ", " << stage.last << "] checkpointing " << checkpointing;
    }
  }
}

// An expert-parallel rank holds a block's dense parameters and only its own experts, back to
// back; the view must find each held expert there, and know which ones it holds.
TEST(Units, BindsABlockHoldingARunOfItsExperts) {
  const ModelConfig c = tiny();
  const ParamLayout layout(c);
  const Units units(c, layout);
  std::vector<float> whole(size_t(layout.total()));
  init_params(c, layout, 7, whole.data());
  const int unit = Units::block(1);
  const FlatRange r = units.range(unit);
  const int64_t x0 = layout.at("layers.1.moe.experts.0.gate_proj.weight").offset;
  const int64_t stride = 3 * c.ffn_dim * c.hidden_size;
  for (const int64_t first : {int64_t(0), int64_t(1), c.num_experts - 2}) {
    std::vector<float> held(whole.begin() + r.begin, whole.begin() + x0);
    held.insert(held.end(), whole.begin() + x0 + first * stride,
                whole.begin() + x0 + (first + 2) * stride);
    ModelView v;
    units.bind(unit, held.data(), v, first, 2);
    const LayerView& w = v.layers[1];
    EXPECT_EQ(w.router, held.data() + (layout.at("layers.1.moe.router.weight").offset - r.begin));
    EXPECT_TRUE(w.holds_experts(first, 2));
    EXPECT_FALSE(w.holds_experts(first, 3));
    EXPECT_FALSE(w.holds_experts(first - 1, 1));
    for (int64_t e = first; e < first + 2; ++e) {
      const std::string name = "layers.1.moe.experts." + std::to_string(e) + ".down_proj.weight";
      const ParamInfo& down = layout.at(name);
      EXPECT_EQ(0, std::memcmp(w.expert(e) + 2 * c.ffn_dim * c.hidden_size,
                               whole.data() + down.offset, size_t(down.numel()) * 4))
          << name;
      EXPECT_EQ(down.expert, e);
    }
  }
  EXPECT_EQ(layout.at("layers.1.moe.router.weight").expert, -1);
}

// Central differences in f32 on a handful of parameters of most kinds (the router and
// embedding are covered exactly by tests/reference). The loss is O(1) and
// f32 evaluation noise is ~1e-7 relative, so with h = 1e-2 (weights are ~0.02) the truncation
// error O(h^2) and noise/h both stay well under the 5e-2 relative bound used here; the exact
// PyTorch comparison (1e-4) is in tests/reference.
TEST(Transformer, GradientsMatchFiniteDifferences) {
  ModelConfig c = tiny();
  c.z_loss_beta = 1e-2;
  c.aux_loss_alpha = 0.1;
  Transformer m(c);
  m.init(5);
  Batch x = random_batch(c, 1, 16, 3);
  m.zero_grads();
  m.forward_backward(x.tokens.data(), x.targets.data(), x.b, x.t, {});
  const std::vector<float> grad(m.grads().data<float>(),
                                m.grads().data<float>() + m.layout().total());
  int checked = 0;
  for (const char* name :
       {"layers.0.attn.q_proj.weight", "layers.1.attn.v_proj.weight", "layers.0.attn.o_proj.weight",
        "layers.1.moe_norm.weight", "layers.0.moe.experts.1.down_proj.weight", "lm_head.weight",
        "norm.weight", "layers.0.attn_norm.weight"}) {
    const ParamInfo& p = m.layout().at(name);
    for (int64_t j = 0; j < 3; ++j) {
      const int64_t i = p.offset + (j * 7919) % p.numel();
      float* w = m.params().data<float>() + i;
      const float orig = *w, h = 1e-2f;
      *w = orig + h;
      const double up = m.evaluate(x.tokens.data(), x.targets.data(), x.b, x.t, {}).loss();
      *w = orig - h;
      const double down = m.evaluate(x.tokens.data(), x.targets.data(), x.b, x.t, {}).loss();
      *w = orig;
      const double fd = (up - down) / (2 * h);
      if (std::fabs(fd) < 1e-4) continue;  // too small to compare in f32
      EXPECT_NEAR(grad[size_t(i)], fd, 5e-2 * std::fabs(fd) + 1e-5)
          << name << " [" << i - p.offset << "]";
      ++checked;
    }
  }
  EXPECT_GE(checked, 8);
}

// Accumulating two micro-batches of one row, with the CE denominator taken over both, gives
// the gradient of one batch of two rows. The router losses are per micro-batch statistics
// (f_i counts one batch's routing), so they are switched off here; what remains differs only
// by float summation order (1e-5 relative).
TEST(Transformer, GradientAccumulationEqualsTheFullBatch) {
  ModelConfig c = tiny();
  c.aux_loss_alpha = 0;
  Transformer full(c), accum(c);
  full.init(21);
  accum.init(21);
  Batch x = random_batch(c, 2, 24, 8);
  full.forward_backward(x.tokens.data(), x.targets.data(), 2, 24, {});
  int64_t count = 0;
  for (int64_t t : x.targets) count += t != -100;
  for (int r = 0; r < 2; ++r) {
    accum.forward_backward(x.tokens.data() + r * 24, x.targets.data() + r * 24, 1, 24,
                           {.ce_denominator = count, .aux_weight = 0.5f});
  }
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < full.layout().total(); ++i) {
    const double a = full.grads().data<float>()[i], b = accum.grads().data<float>()[i];
    diff += (a - b) * (a - b);
    norm += a * a;
  }
  EXPECT_GT(norm, 0);
  EXPECT_LT(std::sqrt(diff / norm), 1e-5);
}

TEST(Transformer, SaveLoadRoundTripAndRefusesMismatches) {
  const ModelConfig c = tiny();
  Transformer a(c);
  a.init(9);
  const std::string dir = ::testing::TempDir() + "/wl_transformer_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  wl::testing::remove_at_exit(dir);
  ASSERT_TRUE(a.save(dir + "/w.safetensors").ok());
  Transformer b(c);
  ASSERT_TRUE(b.load(dir + "/w.safetensors").ok());
  EXPECT_EQ(0, std::memcmp(a.params().raw(), b.params().raw(), a.params().nbytes()));

  ModelConfig wider = c;
  wider.ffn_dim = 64;
  Transformer w(wider);
  Status s = w.load(dir + "/w.safetensors");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("gate_proj"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("w.safetensors"), std::string::npos) << s.to_string();

  ModelConfig tied = c;
  tied.tie_embeddings = true;
  Transformer t(tied);
  s = t.load(dir + "/w.safetensors");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lm_head.weight"), std::string::npos) << s.to_string();
}

// backward() rounds each Linear's dy once for both of its gradients (model/detail/linear.h
// linear_backward); the split backward of zero-bubble pipelines rounds it again for the deferred
// weight gradient. Rounding is deterministic, so the two give the same gradients bit for bit,
// in f32 and in bf16 (where the rounding is to bf16).
TEST(Transformer, SplitBackwardGivesBackwardsGradientsBitForBit) {
  const ModelConfig c = tiny();
  for (Precision p : {Precision::kF32, Precision::kBF16}) {
    Transformer m(c);
    m.init(4);
    const Batch x = random_batch(c, 2, 24, 9);
    const StepOptions o{.precision = p, .targets = x.targets.data()};
    std::vector<std::vector<float>> grads;
    for (bool split : {false, true}) {
      m.zero_grads();
      StagePass pass(m.pass_model(), {0, m.units().head()}, x.tokens.data(), x.b, x.t, o, nullptr);
      ASSERT_TRUE(pass.forward(nullptr, true).ok());
      pass.loss(x.targets.data());
      if (split) {
        ASSERT_TRUE(pass.backward_inputs(nullptr).ok());
        ASSERT_TRUE(pass.backward_weights().ok());
      } else {
        ASSERT_TRUE(pass.backward(nullptr).ok());
      }
      const float* g = m.grads().data<float>();
      grads.emplace_back(g, g + m.layout().total());
    }
    for (size_t i = 0; i < grads[0].size(); ++i)
      ASSERT_EQ(grads[0][i], grads[1][i]) << precision_name(p) << ", gradient element " << i;
  }
}

TEST(Transformer, Bf16LossIsCloseToF32) {
  const ModelConfig c = tiny();
  Transformer m(c);
  m.init(4);
  Batch x = random_batch(c, 2, 32, 4);
  const double f32 = m.evaluate(x.tokens.data(), x.targets.data(), x.b, x.t, {}).loss();
  const double bf16 =
      m.evaluate(x.tokens.data(), x.targets.data(), x.b, x.t, {.precision = Precision::kBF16})
          .loss();
  // bf16 operands carry 2^-9 relative error; the loss averages it down (see check_numerics.py).
  EXPECT_NEAR(bf16, f32, 2e-2 * f32);
  EXPECT_NE(bf16, f32);  // the rounding really happened
}

// StepOptions::targets: the head computes only the positions with a target and the last
// block's experts only theirs, which must change no number: an RL-like batch (targets on a
// few positions at the end of each row, one row without any) gives the whole pass's losses
// and gradients, through loss() and token_loss(), with and without checkpointing; it must
// hold fewer bytes, or the subset was not taken. Tolerance: the GEMMs run over fewer rows,
// so the weight gradients are summed in another order (f32, ~1e-7 relative each).
TEST(StagePass, ComputesOnlyPositionsWithATargetAndChangesNoNumber) {
  ModelConfig c = tiny();
  c.z_loss_beta = 1e-3;
  Transformer m(c);
  m.init(6);
  Batch x = random_batch(c, 4, 24, 7);
  for (int64_t i = 0; i < x.b * x.t; ++i) {
    const int64_t row = i / x.t, t = i % x.t;
    if (row == 2 || t < x.t - 5) x.targets[size_t(i)] = -100;
  }
  const int64_t N = x.b * x.t;
  const PassModel pm = m.pass_model();
  for (bool checkpointing : {false, true}) {
    for (bool per_token : {false, true}) {
      std::vector<float> grads[2];
      LossTerms losses[2];
      int64_t held[2];
      for (int subset = 0; subset < 2; ++subset) {
        m.zero_grads();
        StepOptions o{.checkpointing = checkpointing};
        if (subset) o.targets = x.targets.data();
        StagePass pass(pm, {0, m.units().head()}, x.tokens.data(), x.b, x.t, o, nullptr);
        const int64_t before = tensor_memory_stats().live_bytes;
        ASSERT_TRUE(pass.forward(nullptr, true).ok());
        held[subset] = tensor_memory_stats().live_bytes - before;
        if (per_token) {
          losses[subset] = pass.token_loss(
              x.targets.data(), [&](std::span<const double> logp, std::span<float> coef) {
                double sum = 0;
                for (int64_t r = 0; r < N; ++r) {
                  if (x.targets[size_t(r)] == -100) continue;
                  coef[size_t(r)] = float(0.1 * double(r % 3 + 1));
                  sum += 0.1 * double(r % 3 + 1) * -logp[size_t(r)];
                }
                return sum;
              });
        } else {
          losses[subset] = pass.loss(x.targets.data());
        }
        ASSERT_TRUE(pass.backward(nullptr).ok());
        const float* g = m.grads().data<float>();
        grads[subset].assign(g, g + m.layout().total());
      }
      const std::string what =
          std::string(checkpointing ? "checkpointing, " : "") + (per_token ? "token_loss" : "loss");
      EXPECT_NEAR(losses[1].ce, losses[0].ce, 1e-6 * std::fabs(losses[0].ce)) << what;
      EXPECT_EQ(losses[1].aux, losses[0].aux) << what;
      EXPECT_EQ(losses[1].z, losses[0].z) << what;
      EXPECT_EQ(losses[1].count, losses[0].count) << what;
      float scale = 0;
      for (float v : grads[0]) scale = std::max(scale, std::fabs(v));
      ASSERT_GT(scale, 0.0f);
      for (size_t i = 0; i < grads[0].size(); ++i) {
        ASSERT_NEAR(grads[1][i], grads[0][i], 1e-5f * scale) << what << ", element " << i;
      }
      if (!checkpointing) {
        EXPECT_LT(held[1], held[0]) << what;
      }
    }
  }
}

// A batch where no position has a target: nothing reaches the head, and the pass still runs,
// through loss() and token_loss().
TEST(StagePass, WithoutAnyTargetComputesNoHeadRowAndGivesNoCrossEntropyGradient) {
  const ModelConfig c = tiny();
  Transformer m(c);
  m.init(2);
  Batch x = random_batch(c, 2, 8, 3);
  std::fill(x.targets.begin(), x.targets.end(), -100);
  const PassModel pm = m.pass_model();
  for (bool per_token : {false, true}) {
    m.zero_grads();
    StagePass pass(pm, {0, m.units().head()}, x.tokens.data(), x.b, x.t,
                   {.targets = x.targets.data()}, nullptr);
    ASSERT_TRUE(pass.forward(nullptr, true).ok());
    const LossTerms l = per_token
                            ? pass.token_loss(x.targets.data(),
                                              [](std::span<const double> logp, std::span<float>) {
                                                EXPECT_EQ(logp.size(), size_t(16));
                                                return 0.0;
                                              })
                            : pass.loss(x.targets.data());
    EXPECT_EQ(l.count, 0);
    EXPECT_EQ(l.ce, 0.0);
    ASSERT_TRUE(pass.backward(nullptr).ok());
    // Only the router's aux and z losses reach the weights: the head gets no gradient.
    const ParamInfo* head = m.layout().find("lm_head.weight");
    ASSERT_NE(head, nullptr);
    const float* g = m.grads().data<float>() + head->offset;
    for (int64_t i = 0; i < head->numel(); ++i) {
      ASSERT_EQ(g[i], 0.0f) << (per_token ? "token_loss" : "loss") << ": lm_head element " << i;
    }
  }
}

}  // namespace
}  // namespace wl::model
