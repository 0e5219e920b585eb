// The band-wise dequantizing Linear against a naive one (double loops over q * scale), on
// shapes with partial 128x128 blocks in both directions and several bands; and the clear
// errors bind_weights gives for a source that does not match the layout.
#include "weightlift/infer/dequant_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "reference_tensors.h"
#include "weightlift/core/random.h"
#include "weightlift/infer/worker.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/reference_transform.h"

namespace wl::infer {
namespace {

// A [rows, cols] fp8 matrix with random codes and per-block scales 2^-8 .. 2^3.
struct Fp8Matrix {
  std::vector<uint8_t> q;
  std::vector<float> scale;
  WeightMatrix view(int64_t rows, int64_t cols) const {
    return {.dtype = DType::kF8E4M3,
            .data = q.data(),
            .scale = scale.data(),
            .rows = rows,
            .cols = cols};
  }
};

Fp8Matrix random_fp8(int64_t rows, int64_t cols, Rng& rng) {
  const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
  Fp8Matrix m;
  for (int64_t i = 0; i < rows * cols; ++i) {
    uint8_t v = uint8_t(rng.next());
    if ((v & 0x7f) == 0x7f) v = 0;  // no NaN codes
    m.q.push_back(v);
  }
  for (int64_t b = 0; b < br * bc; ++b) m.scale.push_back(std::ldexp(1.0f, int(b % 12) - 8));
  return m;
}

TEST(DequantLinear, Fp8MatchesNaiveOverPartialBlocksAndSeveralBands) {
  Rng rng(7);
  // cols 200: two column blocks, the second partial; a band is 256 rows at this width, so
  // 300 rows are two bands, the second partial, and three row blocks, the third partial.
  for (auto [rows, cols, n] :
       {std::tuple<int64_t, int64_t, int64_t>{300, 200, 5}, {96, 64, 1}, {129, 129, 3}}) {
    const Fp8Matrix m = random_fp8(rows, cols, rng);
    const WeightMatrix w = m.view(rows, cols);
    std::vector<float> x(size_t(n * cols)), y(size_t(n * rows), 1.0f), want(y.size()),
        tol(y.size());
    for (float& v : x) v = rng.normal();
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < rows; ++i) {
        double s = 0, abs_sum = 0;
        for (int64_t j = 0; j < cols; ++j) {
          const float deq = fp8_e4m3_to_f32(m.q[size_t(i * cols + j)]) *
                            m.scale[size_t((i / 128) * ((cols + 127) / 128) + j / 128)];
          s += double(x[size_t(t * cols + j)]) * deq;
          abs_sum += std::fabs(double(x[size_t(t * cols + j)]) * deq);
        }
        const size_t k = size_t(t * rows + i);
        want[k] = float(s) + 1.0f;
        // The f32 dot product's worst-case error, gamma_n = n u with u = 2^-24 (Higham),
        // over cols products plus the accumulate, against an exact-enough double.
        tol[k] = float(double(cols + 2) * 0x1.0p-24 * (abs_sum + 1.0));
      }
    }
    AlignedVector<float> scratch;
    dequant_linear(w, x.data(), n, y.data(), /*accumulate=*/true, scratch);
    EXPECT_LE(scratch.size(), size_t(256 * cols));  // one band, never the whole matrix
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(y[i], want[i], tol[i]) << "rows " << rows << " cols " << cols << " element " << i;
    }
  }
}

TEST(DequantLinear, Bf16IsExactWidening) {
  const uint16_t w[6] = {f32_to_bf16(1.5f), f32_to_bf16(-2.0f), f32_to_bf16(0.25f),
                         f32_to_bf16(3.0f), f32_to_bf16(0.0f),  f32_to_bf16(-1.0f)};
  const WeightMatrix m{.dtype = DType::kBF16, .data = w, .rows = 3, .cols = 2};
  const float x[2] = {2.0f, 4.0f};
  float y[3];
  AlignedVector<float> scratch;
  dequant_linear(m, x, 1, y, false, scratch);
  EXPECT_EQ(y[0], 3.0f - 8.0f);
  EXPECT_EQ(y[1], 0.5f + 12.0f);
  EXPECT_EQ(y[2], -4.0f);
}

// bf16 activations on a CPU with bf16 GEMMs: the product of x rounded to bf16 with the bf16
// weights, accumulated in f32, against a double loop over the same rounded values; x's own
// rounding shows against the f32 path, which this path must not silently be.
TEST(DequantLinear, Bf16ActivationsMultiplyTheRoundedActivations) {
  if (!bf16_activations_supported()) GTEST_SKIP() << "this CPU has no bf16 GEMMs";
  Rng rng(9);
  const int64_t rows = 300, cols = 200, n = 7;
  std::vector<uint16_t> wb(size_t(rows * cols));
  for (uint16_t& v : wb) v = f32_to_bf16(rng.normal() / 8.0f);
  const WeightMatrix w{.dtype = DType::kBF16, .data = wb.data(), .rows = rows, .cols = cols};
  std::vector<float> x(size_t(n * cols)), y(size_t(n * rows), 1.0f), f32_path(y);
  for (float& v : x) v = rng.normal();
  AlignedVector<float> scratch;
  dequant_linear(w, x.data(), n, y.data(), /*accumulate=*/true, scratch, /*bf16=*/true);
  dequant_linear(w, x.data(), n, f32_path.data(), true, scratch, false);
  double moved = 0;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < rows; ++i) {
      double s = 1.0, abs_sum = 1.0;
      for (int64_t j = 0; j < cols; ++j) {
        const double p = double(bf16_to_f32(f32_to_bf16(x[size_t(t * cols + j)]))) *
                         double(bf16_to_f32(wb[size_t(i * cols + j)]));
        s += p;
        abs_sum += std::fabs(p);
      }
      const size_t k = size_t(t * rows + i);
      ASSERT_NEAR(y[k], s, double(cols + 2) * 0x1.0p-24 * abs_sum) << "element " << k;
      moved = std::max(moved, double(std::fabs(y[k] - f32_path[k])));
    }
  }
  EXPECT_GT(moved, 0.0) << "the activations were not rounded";
}

// ---- bad sources: each a clear error naming the tensor ----------------------------------------

TEST(BindWeights, MissingWrongShapeAndWrongDtypeNameTheTensor) {
  const model::ModelConfig c = *model::preset("tiny");
  const transfer::LayoutOptions fp8{.tp = 2, .tp_rank = 1, .format = transfer::WeightFormat::kFP8};
  std::vector<float> w(size_t(model::ParamLayout(c).total()), 0.5f);
  std::map<std::string, Tensor> good = tensors_of(transfer::reference_receiver_tensors(c, fp8, w));
  ASSERT_TRUE(bind_weights(c, fp8, lookup_in(good)).ok());

  auto missing = good;
  missing.erase("layers.1.moe.experts.3.down_proj.weight.scale");
  Result<BoundWeights> r = bind_weights(c, fp8, lookup_in(missing));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(
      r.status().message().find(
          "tp rank 1 of 2, fp8): missing tensor 'layers.1.moe.experts.3.down_proj.weight.scale'"),
      std::string::npos)
      << r.status().message();

  auto shape = good;
  shape["layers.0.attn.qkv_proj.weight"] = Tensor::zeros(DType::kF8E4M3, {96, 64});
  r = bind_weights(c, fp8, lookup_in(shape));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(
                "tensor 'layers.0.attn.qkv_proj.weight' has shape [96, 64], expected [64, 64]"),
            std::string::npos)
      << r.status().message();

  // A bf16 engine's tensors handed to an fp8 worker.
  const transfer::LayoutOptions bf16{.tp = 2, .tp_rank = 1};
  auto other = tensors_of(transfer::reference_receiver_tensors(c, bf16, w));
  r = bind_weights(c, fp8, lookup_in(other));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(
                "tensor 'layers.0.attn.qkv_proj.weight' is bf16, expected fp8 e4m3"),
            std::string::npos)
      << r.status().message();
}

TEST(BindWeights, WorkerRefusesAMissingOrMismatchedTpGroup) {
  const model::ModelConfig c = *model::preset("tiny");
  auto w = InferenceWorker::create({.config = c, .layout = {.tp = 2, .tp_rank = 0}});
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("needs a TP group"), std::string::npos)
      << w.status().message();
  w = InferenceWorker::create({.config = c, .layout = {.tp = 3, .tp_rank = 0}});
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("does not divide num_heads"), std::string::npos)
      << w.status().message();
}

}  // namespace
}  // namespace wl::infer
