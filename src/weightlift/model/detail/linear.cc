// GEMM operands at reduced precision are rounded copies held in f32: a product of two bf16
// (or f16) values is exact in f32, so an f32 GEMM over rounded operands computes what a
// bf16 GEMM with f32 accumulation computes, on any CPU. (oneDNN's native bf16 matmul needs
// AVX-512-BF16 or AMX; these machines expose AVX2 only.)
#include "weightlift/model/detail/linear.h"

#include <vector>

#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/gemm.h"

namespace wl::model::detail {
namespace {

// Scratch for rounded operands; one set per thread that calls linear_*.
struct Scratch {
  std::vector<float> a, b;
};
thread_local Scratch tls_scratch;

const float* rounded(Precision p, const float* x, int64_t n, std::vector<float>& buf) {
  if (p == Precision::kF32) return x;
  buf.resize(size_t(n));
  float* out = buf.data();
  const DType t = p == Precision::kBF16 ? DType::kBF16 : DType::kF16;
  parallel_for(n, 1 << 15,
               [&](int64_t b, int64_t e) { round_through(t, x + b, out + b, size_t(e - b)); });
  return out;
}

}  // namespace

void linear_forward(Precision p, const float* x, const float* w, float* y, int64_t n, int64_t in,
                    int64_t out, bool accumulate) {
  if (n == 0) return;
  const float* xa = rounded(p, x, n * in, tls_scratch.a);
  const float* wb = rounded(p, w, out * in, tls_scratch.b);
  kernels::gemm({.m = n,
                 .n = out,
                 .k = in,
                 .a = xa,
                 .lda = in,
                 .b = wb,
                 .ldb = in,
                 .trans_b = true,
                 .c = y,
                 .ldc = out,
                 .beta = accumulate ? 1.0f : 0.0f});
}

void linear_backward_input(Precision p, const float* dy, const float* w, float* dx, int64_t n,
                           int64_t in, int64_t out, bool accumulate) {
  if (n == 0) return;
  const float* da = rounded(p, dy, n * out, tls_scratch.a);
  const float* wb = rounded(p, w, out * in, tls_scratch.b);
  kernels::gemm({.m = n,
                 .n = in,
                 .k = out,
                 .a = da,
                 .lda = out,
                 .b = wb,
                 .ldb = in,
                 .c = dx,
                 .ldc = in,
                 .beta = accumulate ? 1.0f : 0.0f});
}

void linear_backward_weight(Precision p, const float* dy, const float* x, float* dw, int64_t n,
                            int64_t in, int64_t out) {
  if (n == 0) return;
  const float* da = rounded(p, dy, n * out, tls_scratch.a);
  const float* xb = rounded(p, x, n * in, tls_scratch.b);
  kernels::gemm({.m = out,
                 .n = in,
                 .k = n,
                 .a = da,
                 .lda = out,
                 .trans_a = true,
                 .b = xb,
                 .ldb = in,
                 .c = dw,
                 .ldc = in,
                 .beta = 1.0f});
}

void WeightGradients::add(Precision p, const Tensor& dy, int64_t dy_row, const Tensor& x,
                          int64_t x_row, float* dw, int64_t n, int64_t in, int64_t out) {
  if (n == 0) return;
  products_.push_back({p, dy, x, dy_row, x_row, dw, n, in, out});
}

void WeightGradients::run() {
  for (const Product& g : products_) {
    linear_backward_weight(g.p, g.dy.data<float>() + g.dy_row * g.out,
                           g.x.data<float>() + g.x_row * g.in, g.dw, g.n, g.in, g.out);
  }
  products_.clear();
}

void linear_weight_gradient(WeightGradients* later, Precision p, const Tensor& dy, int64_t dy_row,
                            const Tensor& x, int64_t x_row, float* dw, int64_t n, int64_t in,
                            int64_t out) {
  if (later) {
    later->add(p, dy, dy_row, x, x_row, dw, n, in, out);
    return;
  }
  linear_backward_weight(p, dy.data<float>() + dy_row * out, x.data<float>() + x_row * in, dw, n,
                         in, out);
}

}  // namespace wl::model::detail
