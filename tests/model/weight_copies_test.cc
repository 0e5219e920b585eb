// The step's bf16 weight copies (model/weight_copies.h): a bf16 pass that reads them computes
// exactly what one converting each weight per call computes, converts each weight once per
// opening however many times the pass reads it, and never reads a copy made before the weights
// changed.
#include "weightlift/model/weight_copies.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "weightlift/core/cpu.h"
#include "weightlift/core/dtype.h"
#include "weightlift/core/random.h"
#include "weightlift/kernels/gemm.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/transformer.h"

namespace wl::model {
namespace {

struct Batch {
  int64_t b, t;
  std::vector<int64_t> tokens, targets;
};

Batch random_batch(const ModelConfig& c, int64_t b, int64_t t) {
  Rng rng(7);
  Batch x{b, t, {}, {}};
  for (int64_t i = 0; i < b * t; ++i) {
    x.tokens.push_back(int64_t(rng.below(uint64_t(c.vocab_size))));
    x.targets.push_back(i % 5 == 2 ? -100 : int64_t(rng.below(uint64_t(c.vocab_size))));
  }
  return x;
}

// One bf16 forward and backward of `m` over x (checkpointing on, so the backward reruns each
// block's forward: three reads of every weight), reading `copies` when not null; the gradients.
std::vector<float> bf16_gradients(Transformer& m, const Batch& x, WeightCopies* copies) {
  m.zero_grads();
  PassModel pm = m.pass_model();
  pm.weight_copies = copies;
  const StepOptions o{
      .precision = Precision::kBF16, .checkpointing = true, .targets = x.targets.data()};
  StagePass pass(pm, {0, m.units().head()}, x.tokens.data(), x.b, x.t, o, nullptr);
  EXPECT_TRUE(pass.forward(nullptr, true).ok());
  pass.loss(x.targets.data());
  EXPECT_TRUE(pass.backward(nullptr).ok());
  const float* g = m.grads().data<float>();
  return {g, g + m.layout().total()};
}

// The Linear weights a pass of config c reads: qkv, o, and the router and each expert's two
// matrices (a dense layer's MLP two), per layer, and the head.
int64_t linear_weights(const ModelConfig& c) {
  int64_t n = 1;
  for (int l = 0; l < c.num_layers; ++l) n += 2 + (c.dense_layer(l) ? 2 : 1 + 2 * c.num_experts);
  return n;
}

// Where bf16 GEMMs run natively (model/detail/linear.cc); elsewhere bf16 is emulated in f32.
bool copies_apply() { return cpu_info().avx512bf16 && kernels::gemm_bf16_is_native(); }

TEST(WeightCopies, ClosedGivesNothing) {
  WeightCopies copies;
  const std::vector<float> w(10, 1.0f);
  EXPECT_EQ(copies.get({.layer = 0, .role = ParamRole::kQ}, w.data(), 10), nullptr);
  copies.open();
  EXPECT_NE(copies.get({.layer = 0, .role = ParamRole::kQ}, w.data(), 10), nullptr);
  copies.close();
  EXPECT_EQ(copies.get({.layer = 0, .role = ParamRole::kQ}, w.data(), 10), nullptr);
}

TEST(WeightCopies, OneConversionPerWeightPerOpening) {
  WeightCopies copies;
  std::vector<float> w(100), v(100);
  for (int i = 0; i < 100; ++i) w[size_t(i)] = float(i) * 0.25f, v[size_t(i)] = -float(i);
  const WeightKey a{.layer = 1, .role = ParamRole::kGate, .expert = 3};
  const WeightKey b{.layer = 1, .role = ParamRole::kGate, .expert = 4};
  copies.open();
  const uint16_t* first = copies.get(a, w.data(), 100);
  EXPECT_EQ(copies.get(a, w.data(), 100), first);
  EXPECT_EQ(copies.conversions(), 1);
  copies.get(b, v.data(), 100);
  EXPECT_EQ(copies.conversions(), 2);
  EXPECT_EQ(copies.bytes(), 400);
  // The same weight met at another address (rebound between units) is converted again.
  copies.get(a, v.data(), 100);
  EXPECT_EQ(copies.conversions(), 3);
  EXPECT_EQ(bf16_to_f32(copies.get(a, v.data(), 100)[7]), -7.0f);
  // A new opening makes every copy again, from the weights as they are now.
  copies.close();
  w[7] = 3.0f;
  copies.open();
  EXPECT_EQ(bf16_to_f32(copies.get(a, w.data(), 100)[7]), 3.0f);
  EXPECT_EQ(copies.conversions(), 4);
}

TEST(WeightCopies, Bf16PassFromCopiesMatchesPerCallConversionBitForBit) {
  const ModelConfig c = *preset("tiny");
  Transformer m(c);
  m.init(3);
  const Batch x = random_batch(c, 2, 24);
  const std::vector<float> per_call = bf16_gradients(m, x, nullptr);
  WeightCopies copies;
  copies.open();
  const std::vector<float> from_copies = bf16_gradients(m, x, &copies);
  for (size_t i = 0; i < per_call.size(); ++i)
    ASSERT_EQ(per_call[i], from_copies[i]) << "gradient element " << i;
  if (!copies_apply()) {  // bf16 is emulated in f32 here: no copies to keep
    EXPECT_EQ(copies.conversions(), 0);
    return;
  }
  // Forward, rerun and backward read each weight three times; it was converted once (an
  // expert no token chose is never read).
  const int64_t once = copies.conversions();
  EXPECT_GT(once, 0);
  EXPECT_LE(once, linear_weights(c));
  bf16_gradients(m, x, &copies);  // a second micro-batch of the same step
  EXPECT_EQ(copies.conversions(), once);
}

TEST(WeightCopies, AStepAfterTheWeightsChangeReadsTheNewWeights) {
  const ModelConfig c = *preset("tiny");
  Transformer m(c);
  m.init(3);
  const Batch x = random_batch(c, 2, 24);
  WeightCopies copies;
  copies.open();
  bf16_gradients(m, x, &copies);
  copies.close();  // as a trainer does before its optimizer writes the weights
  float* w = m.params().data<float>();
  for (int64_t i = 0; i < m.layout().total(); ++i) w[i] *= 1.5f;
  copies.open();
  const std::vector<float> from_copies = bf16_gradients(m, x, &copies);
  const std::vector<float> per_call = bf16_gradients(m, x, nullptr);
  for (size_t i = 0; i < per_call.size(); ++i)
    ASSERT_EQ(per_call[i], from_copies[i]) << "gradient element " << i;
}

}  // namespace
}  // namespace wl::model
