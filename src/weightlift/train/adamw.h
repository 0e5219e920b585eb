// AdamW over a model's flat parameter buffer: the moments live in buffers of the same layout,
// weight decay applies to matrices only (ParamInfo::decay), as the usual param groups do.
#pragma once

#include <cstdint>

#include "weightlift/core/tensor.h"
#include "weightlift/model/transformer.h"

namespace wl::train {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // global L2 norm; 0 = no clipping
};

struct StepReport {
  double grad_norm = 0;  // before clipping, after unscaling
  bool skipped = false;  // non-finite gradients (f16 overflow): parameters left unchanged
};

class AdamW {
 public:
  AdamW(const model::ParamLayout& layout, AdamWOptions options);

  // One update with learning rate lr. Gradients are first multiplied by `grad_unscale`
  // (1 / loss scale under f16). A non-finite gradient norm skips the update.
  StepReport step(model::Transformer& model, double lr, double grad_unscale = 1.0);

  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }
  const AdamWOptions& options() const { return options_; }

 private:
  const model::ParamLayout& layout_;
  AdamWOptions options_;
  Tensor m_, v_;       // f32, layout().total() elements each
  int64_t steps_ = 0;  // updates applied so far
};

}  // namespace wl::train
