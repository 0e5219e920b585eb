// The MoE transformer of DESIGN.md with a hand-written backward pass.
//
// Shapes in this layer: B batch, T sequence, N = B*T tokens, d hidden, H / Hkv query and
// key-value heads of Dh each, E experts, K top-k, F expert hidden, V vocabulary.
//
// One call of forward_backward() runs the forward pass, the losses, and the backward pass,
// accumulating into the gradient buffer (so micro-batches add up). With gradient
// checkpointing only each block's input is kept from the forward pass; the backward pass
// recomputes the block's insides from it just before differentiating it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "weightlift/core/safetensors.h"
#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/model/precision.h"

namespace wl::model {

struct LossTerms {
  double ce = 0;   // mean over counted targets
  double aux = 0;  // aux_loss_alpha * mean over layers of aux_l
  double z = 0;    // z_loss_beta * mean over layers of z_l
  double loss() const { return ce + aux + z; }
  int64_t count = 0;  // targets that were not -100
};

struct StepOptions {
  Precision precision = Precision::kF32;
  bool checkpointing = false;
  // The CE gradient is divided by this many targets; 0 = this batch's own count. Gradient
  // accumulation passes the count over all micro-batches so the sum is the full mean.
  int64_t ce_denominator = 0;
  // aux and z gradients are multiplied by this (1 / micro-batches when accumulating).
  float aux_weight = 1.0f;
  // Every gradient is multiplied by this (the f16 loss scale); 1 otherwise.
  float grad_scale = 1.0f;
  // When not null, receives the logits [B, T, V] (f32).
  float* logits_out = nullptr;
};

class Transformer {
 public:
  explicit Transformer(const ModelConfig& config);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  Tensor& params() { return params_; }  // flat f32 [layout().total()]
  Tensor& grads() { return grads_; }    // same layout; zero_grads() clears
  const Tensor& params() const { return params_; }
  const Tensor& grads() const { return grads_; }
  ModelView param_view() { return bind(config_, layout_, params_.data<float>()); }
  ModelView grad_view() { return bind(config_, layout_, grads_.data<float>()); }

  // N(0, 0.02) for matrices (o_proj and down_proj scaled by 1/sqrt(2 * num_layers), as GPT-2
  // does for residual projections), ones for norm gains.
  void init(uint64_t seed);
  void zero_grads();

  // Copies every parameter from a safetensors file (any float dtype; shapes must match the
  // config). Errors name the file and the tensor; extra tensors are an error too.
  Status load(const SafetensorsFile& file);
  Status load(const std::string& path);
  Status save(const std::string& path) const;  // f32

  // tokens, targets: [B, T] int64 (targets -100 = ignore). Adds gradients into grads().
  LossTerms forward_backward(const int64_t* tokens, const int64_t* targets, int64_t batch,
                             int64_t seq, const StepOptions& opts);
  // Forward and losses only (no gradient, nothing kept).
  LossTerms evaluate(const int64_t* tokens, const int64_t* targets, int64_t batch, int64_t seq,
                     const StepOptions& opts);

  const kernels::RopeTable& rope() const { return rope_; }

 private:
  ModelConfig config_;
  ParamLayout layout_;
  Tensor params_, grads_;
  kernels::RopeTable rope_;
};

}  // namespace wl::model
