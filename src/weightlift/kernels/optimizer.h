// Fused AdamW step and global-norm gradient clipping, as torch.optim.AdamW and
// torch.nn.utils.clip_grad_norm_ compute them.
#pragma once

#include <cstdint>

namespace wl::kernels {

struct AdamWArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: p *= 1 - lr * weight_decay
  int64_t step = 1;           // 1-based, after incrementing (bias correction uses it)
  float grad_scale = 1.0f;    // g is multiplied by this first (clipping, loss-scale undo)
};

// torch.optim.AdamW (amsgrad off, maximize off), per element:
//   g = grad * grad_scale; p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// `bf16` (n elements, or null): also receives each updated p rounded to bf16, the same bits as
// convert_f32_to_bf16 (core/dtype.h) gives, written while p is still in cache: a copy kept for
// others (a parameter server's shards) costs its writes, not another pass over the weights.
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a,
                uint16_t* bf16 = nullptr);

// Sum of squares of x[0..n), accumulated in double; combine over tensors, then
// clip_coefficient(sqrt(total), max_norm).
double sum_squares(const float* x, int64_t n);

// torch's rule: min(1, max_norm / (norm + 1e-6)).
float clip_coefficient(double norm, float max_norm);

}  // namespace wl::kernels
