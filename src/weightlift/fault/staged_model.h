// A pipeline with every stage in one process: the model's blocks cut into `stages` stages of
// equal depth, each with its own AdamW, its own gradient clipping and its own learning-rate
// factor, as the stages of a pipeline-parallel job have (parallel/pipeline/pipeline.h), plus the
// embedding and the head as a group of their own that is never lost. It is what CheckFree's
// convergence experiments run on (the paper's own runs keep every stage in one process too),
// and it applies the recovery rules of recovery.h to its stages.
//
// A micro-batch runs the embedding, the stages in an order the caller gives (the swapped
// order of CheckFree+ exchanges the first two and the last two), then the head; its backward
// runs the same order in reverse, so gradients of both orders add up in the same stages
// before the step.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/fault/recovery.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/units.h"
#include "weightlift/train/adamw.h"
#include "weightlift/train/data.h"

namespace wl::fault {

struct StepLoss {
  double ce = 0;    // mean over the batch's targets
  double loss = 0;  // ce + aux + z
};

class StagedModel {
 public:
  // InvalidArgument unless the config is valid, 1 <= stages and stages divides the config's
  // layers (a rebuilt stage takes its neighbours' tensors layer by layer, so every stage has
  // the same depth).
  static Status check_stages(const model::ModelConfig& config, int stages);
  // check_stages, then a model initialised from `seed`.
  static Result<std::unique_ptr<StagedModel>> create(const model::ModelConfig& config, int stages,
                                                     train::AdamWOptions adamw, uint64_t seed);

  int stages() const { return int(stage_ranges_.size()); }
  const model::ModelConfig& config() const { return config_; }
  const model::ParamLayout& layout() const { return layout_; }

  // The stages in order, and in CheckFree+'s swapped order (0 <-> 1, S-2 <-> S-1).
  std::vector<int> normal_order() const;
  std::vector<int> swapped_order() const;

  // One update on `batch`, split into `micro_batches` (which divides its rows): micro-batch m
  // runs the stages in `orders[m % orders.size()]`. Each stage (and the embedding with the
  // head) clips its own gradient to the AdamW options' grad_clip and steps with
  // lr * its learning-rate factor. REQUIRES: every order is a permutation of the stages.
  Result<StepLoss> step(const train::Batch& batch, int micro_batches,
                        const std::vector<std::vector<int>>& orders, double lr);
  // The mean cross-entropy over `batches`, stages in order.
  double evaluate(const std::vector<train::Batch>& batches);

  // Stage s's parameters: its layers' range of the flat buffer (the same size for every s).
  std::span<float> stage_weights(int s);
  std::span<const float> stage_weights(int s) const;
  std::span<const float> weights() const { return weights_; }
  std::span<const float> gradients() const { return grads_; }  // of the last step, unclipped
  // The L2 norm of stage s's gradient of the last step after its clipping (1 before any).
  double grad_norm(int s) const { return groups_[size_t(s)].norm; }
  double lr_factor(int s) const { return groups_[size_t(s)].lr_factor; }
  int64_t optimizer_steps(int s) const { return groups_[size_t(s)].adamw.steps(); }

  // Applies one entry of a recovery plan (not kRollback: checkpoints are the caller's):
  // stage b.stage's weights from its sources, then a fresh AdamW (zero moments, step 0) and
  // learning-rate factor `lr_factor`. kFresh draws the stage as init_params would with
  // `fresh_seed`.
  void rebuild(const Rebuild& b, double lr_factor, uint64_t fresh_seed);

  // Everything an update changes: weights, moments, each group's step, factor and norm.
  struct State {
    std::vector<float> weights, m, v;
    std::vector<int64_t> steps;
    std::vector<double> lr_factors, norms;
  };
  State state() const;
  void set_state(const State& s);

 private:
  StagedModel(const model::ModelConfig& config, int stages, train::AdamWOptions adamw);

  // A stage, or (last) the embedding with the head: its parameters, each a slice of AdamW's
  // so weight decay applies to matrices only.
  struct Group {
    std::vector<size_t> params;  // indices into layout_.params()
    train::AdamW adamw;
    double lr_factor = 1;
    double norm = 1;
  };
  std::vector<train::AdamWSlice> slices(const Group& g);
  double sum_squares(const Group& g) const;
  void reset_moments(Group& g);
  model::PassModel pass_model();  // weights and gradients in the flat buffers
  model::Stage stage_units(int s) const;

  model::ModelConfig config_;
  model::ParamLayout layout_;
  model::Units units_;
  kernels::RopeTable rope_;
  train::AdamWOptions adamw_;
  std::vector<float> weights_, grads_, m_, v_;
  std::vector<model::FlatRange> stage_ranges_;  // block stages
  std::vector<Group> groups_;                   // stages, then the ends
};

}  // namespace wl::fault
