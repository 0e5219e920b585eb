// The MoE transformer of DESIGN.md with a hand-written backward pass.
//
// Shapes in this layer: B batch, T sequence, N = B*T tokens, d hidden, H / Hkv query and
// key-value heads of Dh each, E experts, K top-k, F expert hidden, V vocabulary.
//
// One call of forward_backward() runs the forward pass, the losses, and the backward pass
// (pass.h: a StagePass over every unit), accumulating into the gradient buffer (so
// micro-batches add up). With gradient checkpointing only each block's input is kept from the
// forward pass; the backward pass recomputes the block's insides from it just before
// differentiating it.
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
#include "weightlift/model/pass.h"
#include "weightlift/model/precision.h"
#include "weightlift/model/units.h"

namespace wl::model {

class Transformer {
 public:
  explicit Transformer(const ModelConfig& config);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  const Units& units() const { return units_; }
  Tensor& params() { return params_; }  // flat f32 [layout().total()]
  Tensor& grads() { return grads_; }    // same layout; zero_grads() clears
  const Tensor& params() const { return params_; }
  const Tensor& grads() const { return grads_; }
  ModelView param_view() { return bind(config_, layout_, params_.data<float>()); }
  ModelView grad_view() { return bind(config_, layout_, grads_.data<float>()); }

  void init(uint64_t seed);  // params.h's init_params
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
  // What a StagePass over this model's own buffers computes with.
  PassModel pass_model() { return {config_, layout_, units_, rope_, param_view(), grad_view()}; }

 private:
  ModelConfig config_;
  ParamLayout layout_;
  Units units_;
  Tensor params_, grads_;
  kernels::RopeTable rope_;
};

}  // namespace wl::model
