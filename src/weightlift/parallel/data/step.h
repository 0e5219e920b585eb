// One optimizer step of a global batch on any layout, and the validation loss: what the
// trainer runs every step and `weightlift bench train` times.
//
// Every rank holds the whole global batch (each draws it from the same seeded sampler) and
// takes its rows of each micro-batch (layout.h's micro_batch_rows). The cross-entropy gradient
// of every micro-batch on every rank is divided by the target count of the whole batch, and
// the aux and z gradients by the number of micro-batches, so the gradients added over
// micro-batches and summed over ranks are those of the single process with the same
// micro-batches.
#pragma once

#include <functional>
#include <vector>

#include "weightlift/model/pass.h"
#include "weightlift/model/precision.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/train/adamw.h"
#include "weightlift/train/data.h"

namespace wl::parallel {

struct StepSettings {
  model::Precision precision = model::Precision::kF32;
  bool checkpointing = false;  // gradient checkpointing
  double lr = 0;
  double loss_scale = 1;  // f16's dynamic loss scale; 1 otherwise
  // Routing replay over the global batch: [rows * seq, num_layers, top_k] experts
  // (model::StepOptions::replay_routes); null: none. routes_out, when not null, receives the
  // experts every token of this rank's rows went to (other rows untouched), replay_differ
  // this rank's token-layers whose replayed experts were not the router's own choice.
  const int32_t* replay_routes = nullptr;
  int32_t* routes_out = nullptr;
  int64_t* replay_differ = nullptr;
};

struct StepResult {
  model::LossTerms loss;  // of the whole global batch, the same on every rank
  train::StepReport report;
};

// Collective over the data-parallel ranks.
Result<StepResult> run_step(DataParallel& dp, const train::Batch& global,
                            const StepSettings& settings);

// The first half of run_step: every micro-batch forward and backward, and the gradients
// summed over the ranks (dp.reduce_gradients), without the update. Its loss, like run_step's.
Result<model::LossTerms> compute_gradients(DataParallel& dp, const train::Batch& global,
                                           const StepSettings& settings);

// A loss of the caller's choosing (policy gradients, SFT on completions only) in place of the
// mean cross-entropy: `part` runs it on `pass` after forward (pass.loss() or
// pass.token_loss(); the pass holds rows [rows.begin, rows.end) of the global batch) and returns
// its terms with `ce` this micro-batch's part of a sum; the step's loss is that sum over
// micro-batches and ranks divided by `divisor`. aux and z are added as for the cross-entropy.
// `part` takes the loss of a micro-batch's pass over the global batch's targets of its rows
// (StepOptions::targets: the pass computes only the positions that have one).
struct MicroBatchLoss {
  std::function<model::LossTerms(model::StagePass& pass, RowRange rows)> part;
  double divisor = 1;
};
Result<model::LossTerms> compute_gradients(DataParallel& dp, const train::Batch& global,
                                           const StepSettings& settings,
                                           const MicroBatchLoss& loss);

// A step's loss from its five sums over micro-batches and ranks (cross-entropy part, aux, z,
// routing slots, slots dropped), the first divided by `divisor`; `count` its targets.
model::LossTerms step_loss(const double sums[5], double divisor, int64_t count);

// The cross-entropy over `batches` (each split over the ranks like a micro-batch; every batch
// has a multiple of ranks() rows), the same on every rank. Collective.
Result<double> evaluate(DataParallel& dp, const std::vector<train::Batch>& batches,
                        model::Precision precision);

}  // namespace wl::parallel
