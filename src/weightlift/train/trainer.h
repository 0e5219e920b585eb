// The single-process training loop: data, forward/backward with gradient accumulation,
// clipping, AdamW on the schedule, validation, metrics (metrics.h) and checkpoints. It prints
// nothing: `on_step` hears of every update, and `weightlift train` draws its progress bar
// from that and its loss plot from metrics.jsonl.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/model/precision.h"
#include "weightlift/train/adamw.h"
#include "weightlift/train/metrics.h"
#include "weightlift/train/schedule.h"

namespace wl::train {

struct TrainOptions {
  // What to train.
  std::string preset = "small";  // used unless config_path is set
  std::string config_path;       // a config.json
  std::string init_weights;      // start from these weights (safetensors) instead of init
  std::string resume;            // a checkpoint directory to continue from, bit-exactly
  uint64_t seed = 1234;          // weights init and data order
  // Data.
  std::string corpus_dir = "data/brown";
  std::string batch_file;  // safetensors with int64 tokens/targets: train on it only
  int64_t batch = 8;       // rows per micro-batch
  int64_t seq = 0;         // tokens per row; 0 = the config's max_seq_len
  int64_t grad_accum = 1;  // micro-batches per update
  // Optimisation.
  int64_t steps = 600;  // updates in the whole run (also the schedule's length)
  LrSchedule schedule;  // total_steps is set from `steps`
  AdamWOptions adamw;
  model::Precision precision = model::Precision::kF32;
  bool checkpointing = false;  // gradient checkpointing (recompute blocks in backward)
  // Evaluation and output.
  int64_t eval_every = 100;             // updates between validation passes; 0 = only at the end
  int64_t eval_windows = 64;            // validation windows of `seq` tokens
  int64_t checkpoint_every = 0;         // updates between checkpoints; 0 = only at the end
  int64_t stop_after = 0;               // stop (after checkpointing) at this update; 0 = run all
  std::string out_dir = "runs/latest";  // metrics.jsonl, checkpoints, final weights
  std::string out_weights;              // also write the final weights here
  // Called after every update with what metrics.jsonl records for it; may be empty.
  std::function<void(const StepMetrics&)> on_step;
};

struct TrainSummary {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_val_loss = 0;   // NaN without a validation set
  double unigram_entropy = 0;  // nats per byte of the training text; NaN on batch_file
  double tokens_per_s = 0;
  double seconds = 0;
};

Result<TrainSummary> train(const TrainOptions& options);

}  // namespace wl::train
