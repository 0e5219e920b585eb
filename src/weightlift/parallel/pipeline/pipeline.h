// Pipeline parallelism: the model's units cut into stages, each stage its own ranks, the
// micro-batches flowing through them on a schedule (pipeline_schedule.h).
//
// Stage s holds a contiguous run of blocks, the first stage the embedding too and the last
// the final norm and head (and, with tied embeddings, a replica of the embedding: see
// data_parallel.h). A forward pass of micro-batch m on stage s receives the [rows * seq, d]
// activations of stage s - 1, runs its units (model/pass.h) and sends its output to stage
// s + 1; the last stage computes the loss. A backward pass receives d loss / d output from
// stage s + 1 and sends d loss / d input to stage s - 1. Sends are posted without waiting (two
// neighbours may send to each other at once) and complete before the step ends; a receive
// waits, and that wait is the stage's share of the bubble.
//
// Data parallelism composes: every stage's ranks form a data-parallel group (any --dp-mode),
// each taking its rows of every micro-batch; a micro-batch flows through the stages of one
// data-parallel index. Job rank = stage * dp + data-parallel rank.
#pragma once

#include <vector>

#include "weightlift/model/units.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/parallel/layout/pipeline_schedule.h"

namespace wl::parallel {

// The units of each of `stages` stages: blocks split as evenly as possible (stage s gets
// blocks [s L / p, (s + 1) L / p)), the embedding on the first and the head on the last.
// REQUIRES: 1 <= stages <= num_layers.
std::vector<model::Stage> pipeline_stages(const model::Units& units, int stages);

// What a stage did in one step, seen from its compute thread.
struct PipelineTimes {
  double step_s = 0;
  double waited_s = 0;  // in receives: the bubble, and the neighbours' slowness
};

// One step on this rank's stage (dp.held_units(), dp's `stages` group to its neighbours),
// `schedule` over the layout's micro-batches. Collective over the whole job.
Result<StepResult> run_pipeline_step(DataParallel& dp, const train::Batch& global,
                                     const StepSettings& settings, PipelineSchedule schedule,
                                     PipelineTimes* times = nullptr);

// The first half of run_pipeline_step: every pass of the schedule, and the gradients summed
// (dp.reduce_gradients), without the update. Its loss, like run_pipeline_step's.
Result<model::LossTerms> compute_pipeline_gradients(DataParallel& dp, const train::Batch& global,
                                                    const StepSettings& settings,
                                                    PipelineSchedule schedule,
                                                    PipelineTimes* times = nullptr);

// The same with a loss of the caller's choosing (step.h's MicroBatchLoss), which the last
// stage takes on each micro-batch's pass; routing replay as `settings` has it.
Result<model::LossTerms> compute_pipeline_gradients(DataParallel& dp, const train::Batch& global,
                                                    const StepSettings& settings,
                                                    PipelineSchedule schedule,
                                                    const MicroBatchLoss& loss,
                                                    PipelineTimes* times = nullptr);

// The cross-entropy over `batches` through the pipeline, the same on every rank (collective).
Result<double> evaluate_pipeline(DataParallel& dp, const std::vector<train::Batch>& batches,
                                 model::Precision precision);

}  // namespace wl::parallel
