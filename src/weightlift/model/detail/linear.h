// The three GEMMs of a Linear layer (y = x W^T) and its backward, at a given precision.
// Internal to the model layer.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/core/tensor.h"
#include "weightlift/model/precision.h"
#include "weightlift/model/weight_copies.h"

namespace wl::model::detail {

// A Linear's weight [out, in] f32, and where a bf16 pass may find it already converted (the
// step's copies, weight_copies.h; null: converted on the call).
struct Weight {
  const float* f32 = nullptr;
  WeightCopies* copies = nullptr;
  WeightKey key;
};

// y[n, out] = x[n, in] @ w[out, in]^T, or += when accumulate.
void linear_forward(Precision p, const float* x, const Weight& w, float* y, int64_t n, int64_t in,
                    int64_t out, bool accumulate = false);
// dx[n, in] = dy[n, out] @ w[out, in], or += when accumulate.
void linear_backward_input(Precision p, const float* dy, const Weight& w, float* dx, int64_t n,
                           int64_t in, int64_t out, bool accumulate = false);
// dw[out, in] += dy[n, out]^T @ x[n, in].
void linear_backward_weight(Precision p, const float* dy, const float* x, float* dw, int64_t n,
                            int64_t in, int64_t out);

// Weight gradients kept for later: a zero-bubble pipeline stage
// (parallel/layout/pipeline_schedule.h) runs its input gradients first, sends them to the stage
// before, and only then its weight gradients. Each product keeps the tensors it reads alive until
// it runs; they run in the order added, so the gradients are those of running each at once, bit for
// bit.
class WeightGradients {
 public:
  // dw[out, in] += dy^T x over n rows: dy's rows [dy_row, dy_row + n) of `dy` [*, out] and
  // x's rows [x_row, x_row + n) of `x` [*, in].
  void add(Precision p, const Tensor& dy, int64_t dy_row, const Tensor& x, int64_t x_row, float* dw,
           int64_t n, int64_t in, int64_t out);
  void run();  // every product added, in order; then it holds none
  bool empty() const { return products_.empty(); }

 private:
  struct Product {
    Precision p;
    Tensor dy, x;
    int64_t dy_row, x_row;
    float* dw;
    int64_t n, in, out;
  };
  std::vector<Product> products_;
};

// Both gradients of a Linear y = x W^T, from one rounding of dy: dx[n, in] = dy @ W (or +=
// with `accumulate`) and dw[out, in] += dy^T x. dy is rows [dy_row, dy_row + n) of a [*, out]
// tensor, x rows [x_row, x_row + n) of a [*, in] one.
struct LinearGrads {
  const Tensor& dy;
  int64_t dy_row = 0;
  const Tensor& x;
  int64_t x_row = 0;
  Weight w;
  float* dx = nullptr;
  float* dw = nullptr;
  int64_t n = 0, in = 0, out = 0;
  bool accumulate = false;
};
// At once when `later` is null; else dx now and dw added to `later` (which rounds dy again
// when it runs). Bit for bit what linear_backward_input and linear_weight_gradient compute.
void linear_backward(WeightGradients* later, Precision p, const LinearGrads& g);

// The weight gradient of a Linear: at once when `later` is null, else added to it.
void linear_weight_gradient(WeightGradients* later, Precision p, const Tensor& dy, int64_t dy_row,
                            const Tensor& x, int64_t x_row, float* dw, int64_t n, int64_t in,
                            int64_t out);

}  // namespace wl::model::detail
