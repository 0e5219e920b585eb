#include "weightlift/train/adamw.h"

#include <cmath>

#include "weightlift/kernels/optimizer.h"

namespace wl::train {

AdamW::AdamW(const model::ParamLayout& layout, AdamWOptions options)
    : layout_(layout),
      options_(options),
      m_(Tensor::zeros(DType::kF32, {layout.total()})),
      v_(Tensor::zeros(DType::kF32, {layout.total()})) {}

StepReport AdamW::step(model::Transformer& model, double lr, double grad_unscale) {
  float* p = model.params().data<float>();
  const float* g = model.grads().data<float>();
  StepReport r;
  const double norm = std::sqrt(kernels::sum_squares(g, layout_.total())) * grad_unscale;
  r.grad_norm = norm;
  if (!std::isfinite(norm)) {
    r.skipped = true;
    return r;
  }
  const float clip =
      options_.grad_clip > 0 ? kernels::clip_coefficient(norm, float(options_.grad_clip)) : 1.0f;
  ++steps_;
  for (const model::ParamInfo& info : layout_.params()) {
    kernels::adamw_step(p + info.offset, g + info.offset, m_.data<float>() + info.offset,
                        v_.data<float>() + info.offset, info.numel(),
                        {.lr = float(lr),
                         .beta1 = float(options_.beta1),
                         .beta2 = float(options_.beta2),
                         .eps = float(options_.eps),
                         .weight_decay = info.decay ? float(options_.weight_decay) : 0.0f,
                         .step = steps_,
                         .grad_scale = float(grad_unscale) * clip});
  }
  return r;
}

}  // namespace wl::train
