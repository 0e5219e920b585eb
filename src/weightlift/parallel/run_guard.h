// What a training run may touch and what it may not go on with.
//
// Before a run starts (check_run_plan): the files it will write (its output directory's
// metrics.jsonl, config.json, model.safetensors, loss.svg, its checkpoints, --out-weights)
// may replace none of its inputs (the config, the initial weights, the batch file, the
// checkpoint it resumes from), nothing that is not a regular file or directory, and no other
// run's results unless the user says --overwrite; a resumed run's checkpoint must lie inside
// its schedule. All of it is checked before anything is allocated or written, so a refused run
// leaves everything as it was.
#pragma once

#include <cstdint>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/parallel/trainer.h"

namespace wl::parallel {

// The checks above, in that order, then the memory the run needs for `config`
// (model/memory_estimate.h); InvalidArgument naming the flags at fault, ResourceExhausted
// with the estimate.
Status check_run_plan(const TrainOptions& options, const model::ModelConfig& config);

}  // namespace wl::parallel
