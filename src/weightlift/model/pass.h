// One micro-batch through a run of the model's units (units.h): the forward pass, the losses,
// the backward pass.
//
// A single process runs one pass over every unit (Transformer::forward_backward). A pipeline
// stage runs passes over its own units, several micro-batches in flight, taking its input
// from the stage before and its output gradient from the stage after. Data-parallel trainers
// watch a pass through PassHooks: FSDP gathers a unit's parameters before it runs and frees
// them after, DDP starts reducing a unit's gradients once its backward is done, and every
// data-parallel layout sums the router's counts over the ranks that share the micro-batch so
// the aux and z losses are those of the whole micro-batch (kernels/router.h).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/kernels/router.h"
#include "weightlift/model/config.h"
#include "weightlift/model/expert_exchange.h"
#include "weightlift/model/params.h"
#include "weightlift/model/precision.h"
#include "weightlift/model/tensor_parallel.h"
#include "weightlift/model/units.h"
#include "weightlift/model/weight_copies.h"

namespace wl::model {

namespace detail {
struct BlockActs;
struct BlockContext;
class WeightGradients;
struct Weight;
}  // namespace detail

struct LossTerms {
  double ce = 0;   // mean over counted targets
  double aux = 0;  // aux_loss_alpha * mean over layers of aux_l
  double z = 0;    // z_loss_beta * mean over layers of z_l
  double loss() const { return ce + aux + z; }
  int64_t count = 0;  // targets that were not -100
  // The routing slots of the layers that route and those dropped over capacity (config's
  // capacity_factor; 0 when dropless): the drop rate is dropped / slots.
  int64_t slots = 0;
  int64_t dropped = 0;
};

struct StepOptions {
  Precision precision = Precision::kF32;
  bool checkpointing = false;
  // The CE gradient is divided by this many targets; 0 = this batch's own count. Gradient
  // accumulation and data parallelism pass the count over the whole step, so that the
  // gradients of every micro-batch on every rank add up to the gradient of the mean.
  int64_t ce_denominator = 0;
  // aux and z gradients are multiplied by this (1 / micro-batches when accumulating).
  float aux_weight = 1.0f;
  // Every gradient is multiplied by this (the f16 loss scale); 1 otherwise.
  float grad_scale = 1.0f;
  // When not null, receives the logits [B, T, V] (f32).
  float* logits_out = nullptr;
  // The targets [B, T] the loss will be taken over, when known before the forward pass (the
  // same array loss() or token_loss() is then given). A position without one (-100) reaches
  // no loss, so the head computes only the positions that have one, and the last block's
  // experts run only for those (its router still sees every token: the aux and z losses and
  // the routes are unchanged). Ignored with logits_out, which wants every position. Null:
  // every position.
  const int64_t* targets = nullptr;
  // Routing replay (R3): token i of the pass goes, in layer l, to the top_k experts at
  // replay_routes[(i * num_layers + l) * top_k] instead of the router's choice (a token whose
  // first entry is -1 keeps the router's). The gate weights are the router's probabilities at
  // those experts, so the router keeps its gradient. An entry marked dropped
  // (kernels::dropped_route) drops that slot; a replaying pass drops as given and applies no
  // capacity of its own, to any of its tokens (those with -1 first, padding in RL, drop
  // nothing). Null: no replay.
  const int32_t* replay_routes = nullptr;
  // When not null, receives the experts every token went to, laid out as replay_routes (this
  // stage's layers; a slot dropped over capacity marked dropped), and replay_differ the
  // token-layers whose replayed experts differ from the router's own top-k.
  int32_t* routes_out = nullptr;
  int64_t* replay_differ = nullptr;
};

enum class Direction { kForward, kBackward };

// What a parallel trainer does around a pass; every default does nothing, as one process.
// A hook that fails (a dead peer in a collective) returns its status, and the pass stops
// there without running another unit.
class PassHooks {
 public:
  virtual ~PassHooks() = default;
  // Before unit u runs in `dir`. May point u's entries of w and g elsewhere (FSDP gathers the
  // unit into a buffer of its own and binds it there: Units::bind).
  virtual Status before_unit(int unit, Direction dir, ModelView& w, ModelView& g) {
    (void)unit, (void)dir, (void)w, (void)g;
    return ok_status();
  }
  // After unit u ran in `dir`. After a backward, u's gradients in g hold this micro-batch's
  // added to what they held before.
  virtual Status after_unit(int unit, Direction dir, ModelView& w, ModelView& g) {
    (void)unit, (void)dir, (void)w, (void)g;
    return ok_status();
  }
  // Sums layer `layer`'s router slot counts [experts] over the ranks that share this
  // micro-batch, in place, and returns the tokens they route (this rank's: `tokens`). It runs
  // deep inside a block and cannot stop it: a failure leaves the counts as they were and is
  // returned by the unit's after_unit().
  virtual int64_t sum_router_counts(int layer, int64_t* counts, int64_t experts, int64_t tokens) {
    (void)layer, (void)counts, (void)experts;
    return tokens;
  }
  // Expert parallelism (expert_exchange.h): what carries this micro-batch's expert rows to
  // their experts' ranks; null: this rank runs every expert. Like the router's sum, an
  // exchange that fails leaves the block running on (with zero rows) and is returned by the
  // unit's after_unit().
  virtual ExpertExchange* expert_exchange() { return nullptr; }
  // Tensor parallelism (tensor_parallel.h): this rank's TP group, when the pass runs one
  // rank's slices of the model (a PassModel of tensor_slices.h's tp_config); null: the whole
  // model here. A failed sum, like a failed exchange, is returned by the unit's after_unit().
  virtual TensorParallel* tensor_parallel() { return nullptr; }
};

// What a pass computes with: the model's maths, and where its weights and gradients are.
struct PassModel {
  const ModelConfig& config;
  const ParamLayout& layout;
  const Units& units;
  const kernels::RopeTable& rope;
  ModelView weights;
  ModelView grads;  // added into by backward
  // The step's bf16 copies of `weights` (weight_copies.h), while the caller holds the weights
  // still; null: each Linear converts its weight per call.
  WeightCopies* weight_copies = nullptr;
};

struct Stage {
  int first = 0, last = 0;  // units [first, last]
};

// Bytes of tensors a StagePass over `stage` holds from the end of forward(x, true) to its
// backward: every block's saved activations (only its input under gradient checkpointing), the
// stage's output, and with the head the final norm's output and the logits; each tensor as
// allocated (core/tensor.h rounds to 64 bytes). Expert rows are counted as tokens x top_k,
// which expert parallelism matches only when routing is balanced. A test holds it to what a
// pass allocates; `weightlift model-info` prints it per micro-batch. A pass given
// StepOptions::targets with positions that have none holds less (the head's rows and the last
// block's expert rows are only those with a target): for it, this is an upper bound.
uint64_t activation_bytes(const ModelConfig& config, Stage stage, int64_t batch, int64_t seq,
                          bool checkpointing);

class StagePass {
 public:
  // tokens [batch, seq] is borrowed for the pass's life: the embedding's forward and backward
  // read it (stages without the embedding may pass null).
  StagePass(const PassModel& model, Stage stage, const int64_t* tokens, int64_t batch, int64_t seq,
            const StepOptions& options, PassHooks* hooks);
  ~StagePass();
  StagePass(const StagePass&) = delete;
  StagePass& operator=(const StagePass&) = delete;

  // x_in [N, d]: the previous stage's output (ignored when the stage starts at the
  // embedding). `for_backward` keeps what backward() needs (only block inputs under
  // gradient checkpointing); false keeps nothing, for evaluation.
  [[nodiscard]] Status forward(const float* x_in, bool for_backward);
  // [N, d]: the output of a stage that ends before the head.
  const Tensor& output() const { return x_; }
  // The losses (stages with the head, after forward): cross-entropy over `targets` [B, T] and
  // the aux and z shares of this stage's layers. Keeps d loss / d logits for backward().
  LossTerms loss(const int64_t* targets);
  // The loss a caller chooses per target token (policy gradients), instead of loss()'s mean
  // cross-entropy: `fn` gets logp[r] = log softmax(logits_r)[target_r] for every row (0 where
  // the target is ignored) and fills coef[r], with d loss / d logits_r = coef[r] (softmax_r -
  // onehot(target_r)) (ignored rows: unused), returning the loss's value on this pass, which
  // goes to LossTerms::ce. Stages with the head, after forward (one that kept nothing for
  // backward gives the log-probabilities and no gradient).
  using TokenLossFn = std::function<double(std::span<const double> logp, std::span<float> coef)>;
  LossTerms token_loss(const int64_t* targets, const TokenLossFn& fn);
  // The backward pass, from the loss gradient (stages with the head: dout null) or from dout
  // [N, d], d loss / d output (others).
  [[nodiscard]] Status backward(const float* dout);
  // The backward pass in two halves, for zero-bubble pipelines
  // (parallel/layout/pipeline_schedule.h): backward_inputs() is backward() but for the weight
  // gradients of the Linears, which it keeps, with what they read, for backward_weights();
  // input_grad() is ready after it. The gradients come out bit for bit as backward()'s. Every
  // unit's after_unit hook runs in backward_weights(), once its gradients are complete, after all
  // the units' before_unit: hooks that hold a unit's parameters or gradients only while it runs
  // (FSDP, ZeRO-2) need backward().
  [[nodiscard]] Status backward_inputs(const float* dout);
  [[nodiscard]] Status backward_weights();
  // [N, d]: d loss / d the stage's input (stages after the embedding), after backward().
  const Tensor& input_grad() const { return dx_; }
  // This stage's layers' aux and z, summed over layers, unweighted.
  const kernels::RouterLosses& router_losses() const { return router_; }
  // The same as the loss's terms: aux and z weighted as loss() weighs them (the coefficients
  // over the model's routing layers), with the slots routed and dropped; ce and count 0. What
  // a stage without the head adds to the step's loss.
  LossTerms router_terms() const;

 private:
  bool has_head() const { return stage_.last == model_.units.head(); }
  void forward_unit(int unit, bool for_backward);
  Status run_backward(const float* dout, bool defer_weights);
  void backward_unit(int unit, detail::WeightGradients* later);
  detail::BlockContext block_context(int layer) const;  // the maths and routing of a layer
  detail::Weight head_weight(const ModelView& w) const;

  PassModel model_;
  Stage stage_;
  const int64_t* tokens_;
  int64_t batch_, seq_, tokens_n_;
  StepOptions options_;
  PassHooks default_hooks_;
  PassHooks* hooks_;
  // StepOptions::targets: the head's rows (positions with a target) and which tokens the
  // last block must finish (keep_); both empty when every position is computed.
  bool head_subset() const { return !keep_.empty(); }
  // The targets of the head's rows: `targets` itself, or those rows' gathered into `kept`.
  const int64_t* targets_of_head_rows(const int64_t* targets, std::vector<int64_t>& kept) const;
  std::vector<int64_t> head_rows_;
  std::vector<uint8_t> keep_;
  std::vector<detail::BlockActs> acts_;  // per layer of the stage
  Tensor x_;                             // running activation [N, d]; the output after forward
  Tensor xf_, rstd_;                     // head: final norm output and its 1/rms
  Tensor logits_;                        // head: [N, V], d loss / d logits after loss()
  Tensor dx_;                            // running gradient; the input gradient after backward
  kernels::RouterLosses router_;
  std::vector<detail::WeightGradients> later_;  // per unit, between the backward's halves
  bool forward_done_ = false;
  bool loss_done_ = false;
  bool weights_pending_ = false;
};

}  // namespace wl::model
