// CheckFree's experiment on one machine: a pipeline with every stage in one process
// (staged_model.h) trained for a number of iterations while stages are lost on a seeded
// schedule and come back by a recovery strategy (recovery.h). The same schedule, drawn from
// `fail_seed` alone, hits every strategy, so their runs differ only in how they recover.
//
// An iteration is one unit of wall-clock: the model's own progress is its optimizer steps,
// which a checkpoint rollback takes back while the iterations go on. Losses happen at the
// start of an iteration, before its step, as the paper injects them.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/fault/failure_schedule.h"
#include "weightlift/fault/recovery.h"
#include "weightlift/model/config.h"
#include "weightlift/train/adamw.h"
#include "weightlift/train/schedule.h"

namespace wl::fault {

// What happened at one iteration; validation only at evaluation points (NaN elsewhere).
struct IterationRecord {
  int64_t iteration = 0;
  int64_t progress = 0;  // the model's optimizer steps after this iteration
  double loss = 0;       // training loss of this iteration's batch
  double val_loss = 0;
  int64_t losses = 0;  // stage losses so far
  double seconds = 0;  // since the run started
};

struct LossRecord {
  int64_t iteration = 0;
  std::vector<Rebuild> plan;    // one entry per lost stage
  int64_t rolled_back_to = -1;  // checkpoint: the progress restored; -1 otherwise
  double loss_before = 0;       // the iteration before's training loss (NaN at the first)
  double loss_after = 0;        // this iteration's, right after the recovery
  double recovery_ms = 0;       // rebuilding (or restoring) until the step can start
};

struct SimulationOptions {
  model::ModelConfig config;
  const std::vector<int64_t>* train_tokens = nullptr;  // borrowed token streams
  const std::vector<int64_t>* val_tokens = nullptr;
  int stages = 6;
  Recovery recovery = Recovery::kCheckFree;
  bool swap = false;     // swapped schedule on odd micro-batches (checkfree+ always runs it)
  double fail_prob = 0;  // of each stage, at each iteration
  uint64_t fail_seed = 1;
  std::vector<ScheduledLoss> scheduled;
  int64_t checkpoint_every = 100;  // checkpoint: iterations between checkpoints
  double lr_scale = 1.1;           // a rebuilt stage's learning-rate factor
  int64_t iterations = 1000;       // wall-clock: a rollback's repeated steps count again
  int64_t batch = 8, seq = 64;     // rows and tokens per row of every iteration's batch
  // Micro-batches per iteration; the swapped schedule runs the odd ones swapped, so it needs an
  // even count.
  int micro_batches = 4;
  // Constant, as the paper's LLaMa runs; a rebuilt stage's rate is this times lr_scale.
  train::LrSchedule schedule{.base_lr = 1e-3, .min_lr = 1e-3, .warmup_steps = 0};
  // Adam as the paper trains: betas (0.9, 0.999), no weight decay, each stage clipped to 1.
  train::AdamWOptions adamw{
      .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .grad_clip = 1.0};
  int64_t eval_every = 50;
  int64_t eval_windows = 64;  // validation windows of `seq` tokens, in batches of `batch`
  uint64_t seed = 1;          // weights and data order
  std::function<void(const IterationRecord&)> on_iteration;
  std::function<void(const LossRecord&)> on_loss;
};

struct SimulationResult {
  std::vector<IterationRecord> evaluations;  // every validation point
  std::vector<LossRecord> losses;
  int64_t iterations = 0, progress = 0;
  double final_val_loss = 0;
  double seconds = 0;       // the whole run, validation included
  double step_seconds = 0;  // mean time of one iteration's update
  int64_t checkpoints = 0;
  double checkpoint_write_ms = 0;  // mean, checkpoint strategy
};

// InvalidArgument naming what cannot run (the token streams aside): stages that do not divide
// the layers, a strategy the layout cannot support, a batch the micro-batches do not divide,
// a swapped schedule without an even number of micro-batches, a loss outside the run.
Status check_simulation(const SimulationOptions& options);

Result<SimulationResult> simulate(const SimulationOptions& options);

}  // namespace wl::fault
