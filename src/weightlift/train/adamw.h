// AdamW over slices of the model's parameters, each with its gradient and its two moments:
// every parameter whole on one rank, or the shards a rank owns when the optimizer state is
// sharded (ZeRO, FSDP: parallel/). Weight decay applies to matrices only (ParamInfo::decay),
// as the usual parameter groups do. Gradients are clipped by their global L2 norm, which the
// caller computes over every rank's gradients.
#pragma once

#include <cstdint>
#include <span>

namespace wl::train {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // global L2 norm; 0 = no clipping
};

struct AdamWSlice {
  float* param;  // n elements, updated in place
  const float* grad;
  float* m;  // first moment
  float* v;  // second moment
  int64_t n = 0;
  bool decay = false;
  // Null, or n elements that also receive the updated weights rounded to bf16 (kernels::
  // adamw_step): a copy someone else reads, kept current by the update itself.
  uint16_t* bf16 = nullptr;
};

struct StepReport {
  double grad_norm = 0;  // before clipping, after unscaling
  bool skipped = false;  // non-finite gradients (f16 overflow): parameters left unchanged
};

class AdamW {
 public:
  explicit AdamW(AdamWOptions options) : options_(options) {}

  // One update of every slice with learning rate lr. grad_sum_squares: the sum of the squared
  // gradients of the whole model, before unscaling; gradients are multiplied by
  // `grad_unscale` (1 / loss scale under f16). A non-finite norm skips the update.
  StepReport step(std::span<const AdamWSlice> slices, double lr, double grad_unscale,
                  double grad_sum_squares);

  // Whether step() with these arguments updates anything (a finite norm).
  static bool updates(double grad_sum_squares, double grad_unscale);

  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  const AdamWOptions& options() const { return options_; }

 private:
  AdamWOptions options_;
  int64_t steps_ = 0;  // updates applied so far
};

}  // namespace wl::train
