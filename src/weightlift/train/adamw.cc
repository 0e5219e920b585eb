// adamw.h.
#include "weightlift/train/adamw.h"

#include <cmath>

#include "weightlift/kernels/optimizer.h"

namespace wl::train {

bool AdamW::updates(double grad_sum_squares, double grad_unscale) {
  return std::isfinite(std::sqrt(grad_sum_squares) * grad_unscale);
}

StepReport AdamW::step(std::span<const AdamWSlice> slices, double lr, double grad_unscale,
                       double grad_sum_squares) {
  StepReport r;
  const double norm = std::sqrt(grad_sum_squares) * grad_unscale;
  r.grad_norm = norm;
  if (!updates(grad_sum_squares, grad_unscale)) {
    r.skipped = true;
    return r;
  }
  const float clip =
      options_.grad_clip > 0 ? kernels::clip_coefficient(norm, float(options_.grad_clip)) : 1.0f;
  ++steps_;
  for (const AdamWSlice& s : slices) {
    kernels::adamw_step(s.param, s.grad, s.m, s.v, s.n,
                        {.lr = float(lr),
                         .beta1 = float(options_.beta1),
                         .beta2 = float(options_.beta2),
                         .eps = float(options_.eps),
                         .weight_decay = s.decay ? float(options_.weight_decay) : 0.0f,
                         .step = steps_,
                         .grad_scale = float(grad_unscale) * clip},
                        s.bf16);
  }
  return r;
}

}  // namespace wl::train
