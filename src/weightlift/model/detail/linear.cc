// GEMM operands at reduced precision. Where the CPU has bf16 dot products (AVX-512 BF16, AMX)
// a kBF16 operand is converted to bf16 and the GEMM runs on oneDNN's bf16 kernels, 1.3-1.8x
// the f32 rate there (docs/BENCHMARKS.md). Elsewhere, and for kF16, operands are rounded copies
// held in f32: a product of two bf16 (or f16) values is exact in f32, so an f32 GEMM over
// them computes what a bf16 GEMM with f32 accumulation computes, on any CPU. The two agree
// to f32 rounding (the order of the sums differs, and the bf16 kernels flush denormals).
#include "weightlift/model/detail/linear.h"

#include <vector>

#include "weightlift/core/aligned.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/gemm.h"

namespace wl::model::detail {
namespace {

bool bf16_gemms_are_native() {
  static const bool native = cpu_info().avx512bf16 && kernels::gemm_bf16_is_native();
  return native;
}

}  // namespace
}  // namespace wl::model::detail

namespace wl::model {

DType gemm_operand_type(Precision p) {
  return p == Precision::kBF16 && detail::bf16_gemms_are_native() ? DType::kBF16 : DType::kF32;
}

}  // namespace wl::model

namespace wl::model::detail {
namespace {

// Scratch for the operands at reduced precision; one set per thread that calls linear_*.
struct Scratch {
  AlignedVector<float> a, b;
  AlignedVector<uint16_t> a16, b16;
};
thread_local Scratch tls_scratch;

// One GEMM operand as the GEMM takes it.
struct Operand {
  const void* data;
  DType type;
};

Operand operand(Precision p, const float* x, int64_t n, AlignedVector<float>& f32,
                AlignedVector<uint16_t>& bf16) {
  if (p == Precision::kF32) return {x, DType::kF32};
  if (p == Precision::kBF16 && bf16_gemms_are_native()) {
    bf16.resize(size_t(n));
    uint16_t* out = bf16.data();
    parallel_for(n, 1 << 15,
                 [&](int64_t b, int64_t e) { convert_f32_to_bf16(x + b, out + b, size_t(e - b)); });
    return {out, DType::kBF16};
  }
  f32.resize(size_t(n));
  float* out = f32.data();
  const DType t = p == Precision::kBF16 ? DType::kBF16 : DType::kF16;
  parallel_for(n, 1 << 15,
               [&](int64_t b, int64_t e) { round_through(t, x + b, out + b, size_t(e - b)); });
  return {out, DType::kF32};
}

Operand operand_a(Precision p, const float* x, int64_t n) {
  return operand(p, x, n, tls_scratch.a, tls_scratch.a16);
}
Operand operand_b(Precision p, const float* x, int64_t n) {
  return operand(p, x, n, tls_scratch.b, tls_scratch.b16);
}

// A weight [n] as the GEMM takes it: the step's bf16 copy when there is one.
Operand weight_operand(Precision p, const Weight& w, int64_t n) {
  if (p == Precision::kBF16 && w.copies && bf16_gemms_are_native()) {
    if (const uint16_t* copy = w.copies->get(w.key, w.f32, n)) return {copy, DType::kBF16};
  }
  return operand_b(p, w.f32, n);
}

}  // namespace

void linear_forward(Precision p, const float* x, const Weight& w, float* y, int64_t n, int64_t in,
                    int64_t out, bool accumulate) {
  if (n == 0) return;
  const Operand xa = operand_a(p, x, n * in);
  const Operand wb = weight_operand(p, w, out * in);
  kernels::gemm({.m = n,
                 .n = out,
                 .k = in,
                 .a = xa.data,
                 .lda = in,
                 .b = wb.data,
                 .ldb = in,
                 .trans_b = true,
                 .c = y,
                 .ldc = out,
                 .beta = accumulate ? 1.0f : 0.0f,
                 .in_type = xa.type});
}

namespace {

// dx[n, in] = dy @ w (or +=), dy [n, out] already as the GEMM takes it.
void input_gradient(Precision p, const Operand& dy, const Weight& w, float* dx, int64_t n,
                    int64_t in, int64_t out, bool accumulate) {
  const Operand wb = weight_operand(p, w, out * in);
  kernels::gemm({.m = n,
                 .n = in,
                 .k = out,
                 .a = dy.data,
                 .lda = out,
                 .b = wb.data,
                 .ldb = in,
                 .c = dx,
                 .ldc = in,
                 .beta = accumulate ? 1.0f : 0.0f,
                 .in_type = dy.type});
}

// dw[out, in] += dy^T x, dy [n, out] already as the GEMM takes it.
void weight_gradient(Precision p, const Operand& dy, const float* x, float* dw, int64_t n,
                     int64_t in, int64_t out) {
  const Operand xb = operand_b(p, x, n * in);
  kernels::gemm({.m = out,
                 .n = in,
                 .k = n,
                 .a = dy.data,
                 .lda = out,
                 .trans_a = true,
                 .b = xb.data,
                 .ldb = in,
                 .c = dw,
                 .ldc = in,
                 .beta = 1.0f,
                 .in_type = dy.type});
}

}  // namespace

void linear_backward_input(Precision p, const float* dy, const Weight& w, float* dx, int64_t n,
                           int64_t in, int64_t out, bool accumulate) {
  if (n == 0) return;
  input_gradient(p, operand_a(p, dy, n * out), w, dx, n, in, out, accumulate);
}

void linear_backward_weight(Precision p, const float* dy, const float* x, float* dw, int64_t n,
                            int64_t in, int64_t out) {
  if (n == 0) return;
  weight_gradient(p, operand_a(p, dy, n * out), x, dw, n, in, out);
}

void linear_backward(WeightGradients* later, Precision p, const LinearGrads& g) {
  const float* dy = g.dy.data<float>() + g.dy_row * g.out;
  if (later) {
    linear_backward_input(p, dy, g.w, g.dx, g.n, g.in, g.out, g.accumulate);
    later->add(p, g.dy, g.dy_row, g.x, g.x_row, g.dw, g.n, g.in, g.out);
    return;
  }
  if (g.n == 0) return;
  // The rounded dy stays in this thread's scratch `a` through both GEMMs: neither converts
  // into it (the weight and x use scratch `b`, one after the other).
  const Operand da = operand_a(p, dy, g.n * g.out);
  input_gradient(p, da, g.w, g.dx, g.n, g.in, g.out, g.accumulate);
  weight_gradient(p, da, g.x.data<float>() + g.x_row * g.in, g.dw, g.n, g.in, g.out);
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
