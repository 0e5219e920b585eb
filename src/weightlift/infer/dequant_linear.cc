// Band-wise dequantize-then-GEMM of dequant_linear.h.
#include "weightlift/infer/dequant_linear.h"

#include <algorithm>

#include "weightlift/core/check.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/gemm.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::infer {
namespace {

constexpr int64_t kBlock = transfer::kFp8BlockSize;
constexpr int64_t kBandFloats = int64_t(1) << 16;  // 256 KiB of f32
// One band is converted inline (tens of microseconds): an OpenMP fork and join per band
// would cost about as much, and far more when the cores are shared and a team member is
// descheduled. Only a caller dequantizing many rows at once gets the pool.
constexpr int64_t kParallelFloats = kBandFloats;

int64_t band_rows(int64_t cols) {
  return kBlock * std::max<int64_t>(1, kBandFloats / (kBlock * std::max<int64_t>(cols, 1)));
}

}  // namespace

void dequantize_rows(const WeightMatrix& w, int64_t r0, int64_t r1, float* dst) {
  WL_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.rows)
      << "rows [" << r0 << ", " << r1 << ") of " << w.rows;
  const int64_t cols = w.cols;
  if (w.dtype == DType::kBF16) {
    const auto* src = static_cast<const uint16_t*>(w.data) + r0 * cols;
    parallel_for((r1 - r0) * cols, kParallelFloats, [&](int64_t b, int64_t e) {
      convert_bf16_to_f32(src + b, dst + b, size_t(e - b));
    });
    return;
  }
  if (w.dtype == DType::kF32) {
    std::copy_n(static_cast<const float*>(w.data) + r0 * cols, (r1 - r0) * cols, dst);
    return;
  }
  WL_CHECK(w.dtype == DType::kF8E4M3 && w.scale != nullptr) << dtype_name(w.dtype);
  const int64_t scale_cols = transfer::fp8_block_count(cols);
  const auto* src = static_cast<const uint8_t*>(w.data);
  parallel_for(r1 - r0, std::max<int64_t>(1, kParallelFloats / std::max<int64_t>(cols, 1)),
               [&](int64_t b, int64_t e) {
                 for (int64_t i = r0 + b; i < r0 + e; ++i) {
                   float* out = dst + (i - r0) * cols;
                   convert_fp8_e4m3_to_f32(src + i * cols, out, size_t(cols));
                   const float* scales = w.scale + (i / kBlock) * scale_cols;
                   for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
                     const float s = scales[j0 / kBlock];
                     const int64_t j1 = std::min(cols, j0 + kBlock);
                     for (int64_t j = j0; j < j1; ++j) out[j] *= s;
                   }
                 }
               });
}

bool bf16_activations_supported() {
  return cpu_info().avx512bf16 && kernels::gemm_bf16_is_native();
}

BoundWeights widen_weights(const BoundWeights& w, bool keep_bf16,
                           std::vector<AlignedVector<float>>& storage) {
  BoundWeights out = w;
  auto widen = [&](WeightMatrix& m) {
    if (m.data == nullptr || (keep_bf16 && m.dtype == DType::kBF16)) return;
    AlignedVector<float>& f = storage.emplace_back(size_t(m.rows * m.cols));
    dequantize_rows(m, 0, m.rows, f.data());
    m = {.dtype = DType::kF32, .data = f.data(), .rows = m.rows, .cols = m.cols};
  };
  for (BoundLayer& l : out.layers) {
    widen(l.qkv);
    widen(l.o);
    widen(l.router);
    for (BoundExpert& e : l.experts) {
      widen(e.gate_up);
      widen(e.down);
    }
    widen(l.mlp.gate_up);
    widen(l.mlp.down);
  }
  widen(out.head);
  return out;
}

void dequant_linear(const WeightMatrix& w, const float* x, int64_t n, float* y, bool accumulate,
                    AlignedVector<float>& scratch, bool bf16_activations) {
  if (n == 0 || w.rows == 0) return;
  // One GEMM of x (or `xb`, its bf16 rounding) against `rows` rows of the matrix from r0.
  auto multiply = [&](const void* a, const void* b, int64_t r0, int64_t rows, DType type) {
    kernels::gemm({.m = n,
                   .n = rows,
                   .k = w.cols,
                   .a = a,
                   .lda = w.cols,
                   .b = b,
                   .ldb = w.cols,
                   .trans_b = true,
                   .c = y + r0,
                   .ldc = w.rows,
                   .beta = accumulate ? 1.0f : 0.0f,
                   .in_type = type});
  };
  if (w.dtype == DType::kF32) {
    multiply(x, w.data, 0, w.rows, DType::kF32);
    return;
  }
  if (bf16_activations && w.dtype == DType::kBF16 && bf16_activations_supported()) {
    // x rounded to bf16, then one bf16 GEMM over the matrix.
    AlignedVector<uint16_t> xb(size_t(n * w.cols));
    parallel_for(int64_t(xb.size()), kParallelFloats, [&](int64_t b, int64_t e) {
      convert_f32_to_bf16(x + b, xb.data() + b, size_t(e - b));
    });
    multiply(xb.data(), w.data, 0, w.rows, DType::kBF16);
    return;
  }
  const int64_t band = std::min(w.rows, band_rows(w.cols));
  if (scratch.size() < size_t(band * w.cols)) scratch.resize(size_t(band * w.cols));
  for (int64_t r0 = 0; r0 < w.rows; r0 += band) {
    const int64_t r1 = std::min(w.rows, r0 + band);
    dequantize_rows(w, r0, r1, scratch.data());
    multiply(x, scratch.data(), r0, r1 - r0, DType::kF32);
  }
}

}  // namespace wl::infer
