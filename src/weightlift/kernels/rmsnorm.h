// RMSNorm over the last dimension, in f32: y = x * rsqrt(mean(x^2) + eps) * g.
#pragma once

#include <cstdint>

namespace wl::kernels {

// x, y: [n, d]; g: [d]; rstd: [n], saved for backward (may be null when not training).
void rmsnorm_forward(const float* x, const float* g, float* y, float* rstd, int64_t n, int64_t d,
                     float eps);

// dx = d(loss)/dx, overwritten [n, d]; dg += d(loss)/dg [d] (accumulated, not overwritten).
// Deterministic: the dg reduction order does not depend on the thread count.
void rmsnorm_backward(const float* dy, const float* x, const float* g, const float* rstd, float* dx,
                      float* dg, int64_t n, int64_t d);

}  // namespace wl::kernels
