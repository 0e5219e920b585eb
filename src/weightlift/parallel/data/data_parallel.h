// One data-parallel rank's share of the model: its parameters, gradients and AdamW state as
// the layout's --dp-mode keeps them (layout.h), and the pass hooks (model/pass.h) that keep
// the ranks one model:
//
//                   parameters          gradients                        optimizer state
//   ddp             whole               whole, buckets allreduced        whole
//   zero1           whole               whole, buckets allreduced        own shard
//   zero2           whole               per unit, reduce-scattered       own shard
//   fsdp            own shard, units    per unit, reduce-scattered       own shard
//                   gathered on use
//
// (gradient_buckets.h, sharded_params.h, sharded_grads.h). Shards are core/shard.h's rows of
// each parameter (unit_shards.h). ZeRO-1 and -2 allgather the updated shards after each step so
// every rank has the whole parameters again. The router's counts are summed over the ranks in
// every forward pass, so the aux and z losses are those of the whole micro-batch.
//
// Collectives: the router sums and the clipping norm run on `group` from the compute thread;
// everything that can overlap the passes (buckets, gathers, reduce-scatters) runs on the
// CommQueue's own group. Both span the same ranks. With one rank neither exists and nothing
// is communicated.
//
// Expert parallelism (--ep E) splits each stage's data-parallel ranks into groups of E
// consecutive ranks; rank i of a group runs experts [i E', (i + 1) E') of every layer (E' =
// experts / E) for the tokens of the whole group (expert_group.h, model/expert_exchange.h),
// and holds only those: each block is two parts (unit_parts.h), its dense parameters, kept
// as --dp-mode says over the data-parallel ranks, and its run of experts, kept the same way
// over the dp / E ranks that run them (one per expert group; `expert_data`). Whole gradients'
// norm adds the experts' squares over the expert group. gather_params() and gather_grads()
// still give every expert: each rank's run is allgathered over its expert group.
//
// Tensor parallelism (--tp T) runs each data-parallel rank's work on T consecutive ranks,
// each holding and running its slices of every block (model/tensor_slices.h): the rank's
// model is one of tp_config's shape (held_config()), on which everything above runs
// unchanged, each tensor-parallel rank with its own data-parallel groups. Whole-model
// buffers (set_params, gather_*) and checkpoint rows stay in the whole model's coordinates;
// a slice's owner speaks for it in the norm and in checkpoints, so each element counts once.
// Expert parallelism composes with it per TP rank: the expert groups are ranks of one TP
// rank, each running its ffn rows' slice of its own experts.
//
// Under pipeline parallelism a rank holds only its stage's units (DataParallelRanks::units),
// its buffers laid out unit after unit; the gradient norm then adds up over the stages
// (`stages`). With tied embeddings the last stage also holds the embedding, a replica for its
// head: after the data-parallel sums its gradient is added to the first stage's (`tied`, the
// two stages' ranks of one data-parallel index), both apply the same update, and the replica
// is left out of the norm and of checkpoints (as Megatron's embedding group does).
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/tensor.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/units.h"
#include "weightlift/model/weight_copies.h"
#include "weightlift/parallel/data/comm_queue.h"
#include "weightlift/parallel/data/gradient_buckets.h"
#include "weightlift/parallel/data/sharded_grads.h"
#include "weightlift/parallel/data/sharded_params.h"
#include "weightlift/parallel/data/unit_parts.h"
#include "weightlift/parallel/data/unit_shards.h"
#include "weightlift/parallel/layout/layout.h"
#include "weightlift/parallel/model_parallel/expert_group.h"
#include "weightlift/parallel/model_parallel/tensor_group.h"
#include "weightlift/train/adamw.h"

namespace wl::parallel {

struct DataParallelOptions {
  ParallelLayout layout;
  train::AdamWOptions adamw;
  std::chrono::milliseconds timeout{60000};  // every collective's deadline
  // The units this rank holds, ascending (a pipeline stage's); empty: every unit.
  std::vector<int> units;
  // With tied embeddings on a stage that ends at the head but does not start at the
  // embedding: hold the embedding too, as a replica (see the top).
  bool tied_replica = false;
};

// The groups a rank works with; null where there is nothing to talk to.
struct DataParallelRanks {
  std::shared_ptr<comm::Group> group;    // this stage's data-parallel ranks (compute thread)
  std::unique_ptr<CommQueue> queue;      // a second group over the same ranks (its own thread)
  std::shared_ptr<comm::Group> stages;   // the stages of this data-parallel index, in order
  std::shared_ptr<comm::Group> tied;     // the first and last stages (tied embeddings)
  std::shared_ptr<comm::Group> experts;  // --ep consecutive data-parallel ranks (compute thread)
  // The data-parallel ranks that hold the same experts (--ep below the data-parallel size;
  // compute thread; the queue has its own).
  std::shared_ptr<comm::Group> expert_data;
  // --tp consecutive ranks (compute thread), and of them the ranks sharing this rank's kv
  // heads when more than one holds them (tensor_group.h).
  std::shared_ptr<comm::Group> tensor;
  std::shared_ptr<comm::Group> tensor_kv;
};

// What a step cost in communication, as the compute thread saw it.
struct StepComm {
  double exposed_s = 0;          // waiting for collectives: gathers, sums, the end-of-step drain
  int64_t state_bytes = 0;       // parameters, gradients and AdamW state held at the step's end
  int64_t peak_state_bytes = 0;  // the most held at once, gathered units included
};

// Rows of one parameter's weights or AdamW moments on this rank, and where they are: rows
// and columns of the whole parameter (viewed as [shape[0], numel / shape[0]]).
enum class StateKind : uint8_t { kWeights, kM, kV };
struct StateRows {
  size_t param = 0;  // index into ParamLayout::params()
  StateKind kind = StateKind::kWeights;
  ShardRows rows;
  // A band of columns (a tensor-parallel rank's o_proj or down_proj); null: every column.
  std::optional<ShardRows> cols;
  float* data = nullptr;  // rows.size() x the columns, row-major
  int64_t width(const model::ParamInfo& p) const {
    return cols ? cols->size() : p.numel() / std::max<int64_t>(p.shape[0], 1);
  }
  int64_t elems(const model::ParamInfo& p) const { return rows.size() * width(p); }
};

// A bf16 copy of some of this rank's weights that the optimizer writes as it updates them
// (kernels::adamw_step): a parameter server's shards, current after every step without a pass
// of their own over the weights.
struct Bf16Mirror {
  const float* weights = nullptr;  // n of this rank's weights, where the optimizer updates them
  int64_t n = 0;
  uint16_t* bf16 = nullptr;  // n elements, borrowed while the mirror is installed
};
struct Bf16Mirrors {
  std::vector<Bf16Mirror> ranges;  // disjoint
  // Called before and after each optimizer step that writes them (their readers' seqlock); a
  // step that skips its update (non-finite gradients) calls neither.
  std::function<void()> before_write, after_write;
};

class DataParallel final : public model::PassHooks {
 public:
  DataParallel(const model::ModelConfig& config, const DataParallelOptions& options,
               DataParallelRanks ranks);
  // Data parallel alone: group and queue as in DataParallelRanks (both null with one rank).
  DataParallel(const model::ModelConfig& config, const DataParallelOptions& options,
               std::shared_ptr<comm::Group> group, std::unique_ptr<CommQueue> queue);
  ~DataParallel() override;

  // The whole model's.
  const model::ModelConfig& config() const { return config_; }
  const model::ParamLayout& layout() const { return layout_; }
  const model::Units& units() const { return units_; }
  // What this rank's passes run on: the whole model, or under --tp its slices'.
  const model::ModelConfig& held_config() const { return held_config_; }
  const UnitParts& parts() const { return parts_; }
  const DataParallelOptions& options() const { return options_; }
  const std::vector<int>& held_units() const { return held_; }  // ascending, replica included
  bool holds(int unit) const { return at_.count(unit) > 0; }
  bool holds_replica() const { return replica_ >= 0; }
  // The pipeline's stages of this data-parallel index (null without pipeline parallelism),
  // for the compute thread.
  comm::Group* stages() const { return stages_.get(); }
  int rank() const { return rank_; }    // in this stage's data-parallel group
  int ranks() const { return ranks_; }  // data-parallel ranks
  int tp() const { return tp_; }
  int tp_rank() const { return tp_rank_; }
  // In the whole job (layout.h's place_in): (stage * ranks() + rank()) * tp() + tp_rank(),
  // and stages * ranks() * tp().
  int job_rank() const {
    return ((stages_ ? stages_->rank() : 0) * ranks_ + rank_) * tp_ + tp_rank_;
  }
  int job_size() const { return (stages_ ? stages_->size() : 1) * ranks_ * tp_; }
  train::AdamW& optimizer() { return adamw_; }
  // AdamW's slices of unit u's parameters, with their gradients and moments, for an optimizer
  // of the caller's (fault/'s per-stage clip groups). REQUIRES: u held, and held whole with
  // its whole optimizer state (--dp-mode ddp, no --tp, no expert split).
  std::vector<train::AdamWSlice> unit_slices(int unit);
  // A pipeline stage held by one rank (data parallel 1, no --tp, --ep or tied replica) takes
  // its stages group anew: a job that lost a stage and replaced it connects a new group of the
  // stages, and this rank's state goes on unchanged.
  void rebind_stages(std::shared_ptr<comm::Group> stages);

  // Keeps this rank's part of `full` (layout().total() floats: a fresh init, loaded weights).
  void set_params(const float* full);
  // The same, the values written by fill(range, out) into out[range.size()] for each range of
  // the model this rank keeps part of (a held unit's parts; the whole model under --tp): a
  // rank that shards its model never holds more than one part of it whole.
  void set_params(const std::function<void(model::FlatRange range, float* out)>& fill);
  // The held units' whole parameters into `full` (at their places in the model; the rest of
  // `full` untouched) on every data-parallel rank, every expert included (collective: FSDP
  // gathers them, expert parallelism gathers the experts).
  Status gather_params(float* full);
  // The whole model's parameters into `full` on every rank of the job: every stage's own
  // units (collective over the job).
  Status gather_model(float* full);
  // The whole model's parameters where this rank already holds them, whole and at their
  // places in the model (one stage, every expert, a layout that does not shard parameters): a
  // view of what the optimizer updates, valid until the next step; null elsewhere, where
  // gather_model() is the way.
  const float* whole_model() const;
  // The same for the reduced gradients, after reduce_gradients() (collective over the job).
  Status gather_model_grads(float* full);
  // What this rank writes to a checkpoint: its own rows (core/shard.h's, over the
  // data-parallel ranks that hold the parameter: UnitParts::holders) of every parameter's
  // weights and moments. Empty row ranges left out.
  std::vector<StateRows> own_rows();
  // What it must read from one: every row where a state is whole on this rank, its own rows
  // where it is sharded.
  std::vector<StateRows> rows_to_load();

  // One step: begin_step(); for each micro-batch m, begin_micro_batch(m) and a StagePass over
  // pass_model() with this as its hooks; then finish_step(), which is reduce_gradients() and
  // apply_optimizer().
  void begin_step();
  void begin_micro_batch(int micro_batch);
  model::PassModel pass_model();
  // The bf16 copies of the weights pass_model() reads (model/weight_copies.h), for a caller that
  // holds the weights still over a step's passes (step.cc); a layout that shards its parameters
  // (FSDP) keeps none, which would hold the whole model on every rank.
  model::WeightCopies& weight_copies() { return weight_copies_; }
  Result<train::StepReport> finish_step(double lr, double grad_unscale);
  // Waits until every rank's gradients are summed where this layout keeps them.
  Status reduce_gradients();
  // Clips by the global norm and runs AdamW on what this rank owns (then ZeRO-1/2 gather the
  // updated parameters).
  Result<train::StepReport> apply_optimizer(double lr, double grad_unscale);
  // From now on every optimizer step also writes `mirrors` (an empty set: none). False, and
  // the mirrors as they were, unless this rank's optimizer updates every element of every
  // range: rows another rank updates and a gather brings (ZeRO's) cannot be mirrored here.
  bool mirror_bf16(Bf16Mirrors mirrors);
  // Whether the mirrors hold the weights as they are now: true after an optimizer step, false
  // from the next other write of the weights (set_params, rows_to_load, unit_slices) on.
  bool mirrors_current() const { return mirrors_current_; }
  // The whole reduced gradients into `full` on every rank, after reduce_gradients()
  // (collective where gradients are sharded, and under expert parallelism). For tests and
  // diagnostics.
  Status gather_grads(float* full);
  // This rank's own gradients as it holds them (whole, or its packed shards): for tests that
  // hold two runs of one layout to the same bits on every rank, copies of shared tensors
  // included.
  std::span<const float> local_grads() const {
    return {grads_.data<float>(), size_t(grads_.numel())};
  }
  const StepComm& step_comm() const { return comm_; }
  // Parameters, gradients and AdamW state this rank holds between steps (state_bytes.h
  // predicts it from the layout alone).
  int64_t state_bytes() const {
    return params_.nbytes() + grads_.nbytes() + m_.nbytes() + v_.nbytes();
  }

  // Evaluation passes: units are still gathered, but the router's counts are not summed (the
  // ranks evaluate different rows, and only the cross-entropy is reported).
  void set_evaluating(bool evaluating) { evaluating_ = evaluating; }

  // ---- model::PassHooks ----------------------------------------------------------------------
  Status before_unit(int unit, model::Direction dir, model::ModelView& w,
                     model::ModelView& g) override;
  Status after_unit(int unit, model::Direction dir, model::ModelView& w,
                    model::ModelView& g) override;
  int64_t sum_router_counts(int layer, int64_t* counts, int64_t experts, int64_t tokens) override;
  model::ExpertExchange* expert_exchange() override { return experts_.get(); }
  model::TensorParallel* tensor_parallel() override { return tensor_.get(); }

  // values[n] summed over the data-parallel ranks, the same bits on every rank (collective).
  Status sum_over_ranks(double* values, size_t n);
  // ... and over the pipeline's stages too: one model replica, each value once (a loss, which
  // every tensor-parallel rank computes alike).
  Status sum_over_replica(double* values, size_t n);
  // ... and over the tensor-parallel ranks too: every rank of the job.
  Status sum_over_job(double* values, size_t n);

  // Under --tp: FailedPrecondition, naming the first parameter, unless every rank of the TP
  // group holds the same bits of every parameter they all hold whole (embedding, norms,
  // routers, head), and the ranks sharing a kv head the same bits of it. They must, as every
  // rank computes their updates alike; a checkpoint checks it rather than let one copy's
  // drift pass silently (collective over the TP group).
  Status check_tp_replicas();

  // The first failure of a router sum or an expert exchange (neither can return one from
  // inside a block); the unit's after_unit returns it.

 private:
  void build_ownership();
  void build_shards();
  void build_slices();
  void build_reducers();
  std::vector<int> units_read(int unit) const;
  Status allgather_params();
  Status gather_units(const float* local, float* full);
  Status gather_whole(Tensor& state, bool sharded, float* full);
  void copy_held(Tensor& held, float* full);
  Status sum_over_stages(float* full);
  Status reduce_replica();
  double norm_sum_squares() const;
  Result<double> owned_norm_sum_squares();
  // Under --tp: the held units' whole parameters or gradients in `local` (the held layout's)
  // put at their places in `full`, every rank's slices (collective over the TP group).
  Status unslice_over_tensor(const float* local, float* full);
  // A state's rows in the held layout, as rows (and columns) of the whole parameter.
  StateRows whole_rows(size_t param, StateKind kind, ShardRows held_rows, float* data) const;
  Result<double> expert_norm_sum_squares();
  Status gather_experts(float* full);
  void note_bytes();
  // The group a part's collectives on the compute thread run on (null: one rank).
  comm::Group* group_of(const PartShards& part) const;
  // Where unit u (held) starts in the whole buffers, and in the packed shard buffers.
  int64_t whole_at(int unit) const { return at_.at(unit).whole; }
  int64_t packed_at(int unit) const { return at_.at(unit).packed; }
  float* whole_unit(Tensor& t, int unit) { return t.data<float>() + whole_at(unit); }

  model::ModelConfig config_;
  model::ParamLayout layout_;
  model::Units units_;
  int tp_ = 1, tp_rank_ = 0;
  model::ModelConfig held_config_;  // config_, or this TP rank's slices' (tp_config)
  model::ParamLayout held_layout_;
  model::Units held_units_;
  std::vector<bool> owned_;  // by parameter: this TP rank speaks for its slice (tensor_slices.h)
  std::vector<bool> replicated_;  // by parameter: every TP rank holds all of it
  std::vector<bool> shared_kv_;   // by parameter: a kv band some TP ranks share
  UnitParts parts_;               // what this rank holds of each unit
  kernels::RopeTable rope_;
  model::WeightCopies weight_copies_;
  DataParallelOptions options_;
  std::shared_ptr<comm::Group> group_;
  std::unique_ptr<CommQueue> queue_;
  std::shared_ptr<comm::Group> stages_, tied_;
  std::shared_ptr<comm::Group> expert_data_;  // compute thread's; null unless dp / ep > 1
  int rank_ = 0, ranks_ = 1;

  // Per unit of the model, its parts' shards (none for a unit not held). Never resized once
  // built: the reducers keep references into it.
  std::vector<std::vector<PartShards>> shards_;
  struct At {
    int64_t whole = 0, packed = 0;
  };
  std::map<int, At> at_;                 // held units
  std::vector<int64_t> packed_offsets_;  // by unit, for ShardedParams and ShardedGrads
  std::vector<int> held_;
  int replica_ = -1;  // the tied embedding's replica, when held
  int64_t whole_elems_ = 0, packed_elems_ = 0;

  Tensor params_;  // whole held units, or their packed shards (fsdp)
  Tensor grads_;   // whole (ddp, zero1), or packed shards (zero2, fsdp)
  Tensor m_, v_;   // whole (ddp), or packed shards
  train::AdamW adamw_;
  std::vector<train::AdamWSlice> slices_;
  // slices_ split where the mirrors begin and end, each mirrored piece with its bf16 copy.
  std::vector<train::AdamWSlice> mirrored_slices_;
  Bf16Mirrors mirrors_;
  bool mirrors_current_ = false;

  std::optional<GradientBuckets> buckets_;
  std::optional<ShardedParams> sharded_params_;
  std::optional<ShardedGrads> sharded_grads_;

  int micro_batch_ = 0;
  bool evaluating_ = false;
  StepComm comm_;
  Status hook_failure_;
  std::unique_ptr<ExpertGroup> experts_;  // --ep > 1
  std::unique_ptr<TensorGroup> tensor_;   // --tp > 1
};

}  // namespace wl::parallel
