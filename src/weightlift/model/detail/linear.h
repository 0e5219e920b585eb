// The three GEMMs of a Linear layer (y = x W^T) and its backward, at a given precision.
// Internal to the model layer.
#pragma once

#include <cstdint>

#include "weightlift/model/precision.h"

namespace wl::model::detail {

// y[n, out] = x[n, in] @ w[out, in]^T, or += when accumulate.
void linear_forward(Precision p, const float* x, const float* w, float* y, int64_t n, int64_t in,
                    int64_t out, bool accumulate = false);
// dx[n, in] = dy[n, out] @ w[out, in], or += when accumulate.
void linear_backward_input(Precision p, const float* dy, const float* w, float* dx, int64_t n,
                           int64_t in, int64_t out, bool accumulate = false);
// dw[out, in] += dy[n, out]^T @ x[n, in].
void linear_backward_weight(Precision p, const float* dy, const float* x, float* dw, int64_t n,
                            int64_t in, int64_t out);

}  // namespace wl::model::detail
