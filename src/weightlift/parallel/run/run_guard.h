// What a training run may touch and what it may not go on with.
//
// Before a run starts (check_run_plan): the files it will write (its output directory's
// metrics.jsonl, config.json, model.safetensors, loss.svg, its checkpoints, out_weights)
// may replace none of its inputs (the config, the initial weights, the batch file, the
// checkpoint it resumes from), nothing that is not a regular file or directory, and no other
// run's results unless the caller says overwrite; a resumed run's checkpoint must lie inside
// its schedule and have been written with the same hyperparameters, unless the caller says
// allow_changes. All of it is checked before anything is allocated or written, so a refused
// run leaves everything as it was.
//
// While it runs (RunGuard): a loss or weights that are not finite stop the run at that step,
// before anything of it is saved, so the last good checkpoint stays the last one written.
// Under f16 the loss scaler may skip an update whose gradients overflowed (and lower its
// scale); a run that skips max_skips_in_a_row updates in a row is stopped too, since by then
// the scale has reached its floor and the gradients still overflow.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/run/trainer.h"
#include "weightlift/train/metrics.h"

namespace wl::parallel {

// The checks above, in that order, then the memory the run needs for `config`
// (model/memory_estimate.h); InvalidArgument naming the fields at fault, ResourceExhausted
// with the estimate.
Status check_run_plan(const TrainOptions& options, const model::ModelConfig& config);

// Of those, whether `out_dir` holds another run's results (refused unless `overwrite` or a
// resume of that run): checked again once the run holds the directory's lock, since another
// run may have finished there in between.
Status check_other_run(const TrainOptions& options);

// The hyperparameters a resume must keep, by the command line's flag names ("steps" -> "600",
// "lr" -> "0.003"), as the run's checkpoints record them; a refused resume names the fields
// (`base_lr`). `config` is the model the run trains (run_model()): its capacity factor, from
// the flag or its config.json, is recorded when it has one.
std::map<std::string, std::string> run_hyperparameters(const TrainOptions& options,
                                                       const model::ModelConfig& config);

// The sum of squares of the parameters over the whole job: this rank's rows, summed over the
// ranks (collective). Not finite as soon as one parameter anywhere is not.
Result<double> weights_sum_squares(DataParallel& dp);

struct RunGuardOptions {
  // f16: the scale halves on every skip, from 2^16 to its floor of 1 in 16 skips; a few more
  // at the floor and the gradients overflow whatever the scale.
  int max_skips_in_a_row = 24;
};

class RunGuard {
 public:
  explicit RunGuard(RunGuardOptions options = {}) : o_(options) {}

  // After an update (metrics `m`; `weights_sum_squares` of every rank's parameters as they
  // now are, weights_sum_squares() above): Aborted naming the step when the loss or a
  // parameter is not finite, or (f32, bf16) the update was skipped for a gradient that is
  // not finite, or (f16) too many updates in a row were skipped. Every rank decides alike:
  // its inputs are the same on every rank.
  Status after_update(const train::StepMetrics& m, model::Precision precision,
                      double weights_sum_squares);
  // The checkpoint a stopped run can be resumed from, named in the error.
  void saved(const std::string& checkpoint_dir) { last_good_ = checkpoint_dir; }

 private:
  Status stop(int64_t step, const std::string& what) const;

  RunGuardOptions o_;
  std::string last_good_;
  int skipped_in_a_row_ = 0;
};

}  // namespace wl::parallel
