// The training loop, for one process or many: data, micro-batches forward and backward on the
// layout's ranks (step.h), clipping, AdamW on the schedule, validation, metrics and
// checkpoints (checkpoint.h), inside the one training run of train/run.h (its outputs,
// schedule, metrics stream and resume). It prints nothing: `on_step` hears of every update,
// and `weightlift train` draws its progress bar from that and its loss plot from metrics.jsonl.
//
// Every rank runs train() with the same options. Rank 0 alone writes metrics.jsonl,
// config.json and model.safetensors; every rank writes its part of each checkpoint.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/status.h"
#include "weightlift/model/params.h"
#include "weightlift/model/precision.h"
#include "weightlift/parallel/layout/layout.h"
#include "weightlift/train/adamw.h"
#include "weightlift/train/data.h"
#include "weightlift/train/metrics.h"
#include "weightlift/train/run.h"
#include "weightlift/train/schedule.h"

namespace wl::parallel {

class DataParallel;

struct TrainOptions {
  // What to train.
  std::string preset = "small";  // used unless config_path is set
  std::string config_path;       // a config.json
  std::string init_weights;      // start from these weights (safetensors) instead of init
  // A Hugging Face checkpoint directory: its config and weights (instead of the three above);
  // its tokenizer files go into out_dir/hf.
  std::string model_dir;
  std::string resume;    // a checkpoint directory to continue from, bit-exactly
  uint64_t seed = 1234;  // weights init and data order
  // Token dropping: replaces the config's capacity_factor (model/config.h) when set.
  std::optional<double> capacity_factor;
  // Data.
  std::string corpus_dir = "data/brown";
  std::string batch_file;  // safetensors with int64 tokens/targets: train on it only
  // Or documents (train/documents.h: JSONL {"text"} or blank-line separated text) in the
  // tokens of `tokenizer` (a tokenizer.json; empty: model_dir's, else bytes).
  std::string data_path;
  // Or supervised examples (train/sft.h: JSONL prompt/completion or messages), loss on the
  // completions only, in the same tokens.
  std::string sft_path;
  std::string tokenizer;
  int64_t batch = 8;  // rows of the global batch of one update, over every rank
  int64_t seq = 0;    // tokens per row; 0 = the config's max_seq_len
  // Where it runs: data-parallel mode, micro-batches per update (gradient accumulation).
  ParallelLayout layout;
  // Optimisation.
  int64_t steps = 600;         // updates in the whole run (also the schedule's length)
  train::LrSchedule schedule;  // total_steps is set from `steps`
  train::AdamWOptions adamw;
  model::Precision precision = model::Precision::kF32;
  bool checkpointing = false;  // gradient checkpointing (recompute blocks in backward)
  // Evaluation and output.
  int64_t eval_every = 100;      // updates between validation passes; 0 = only at the end
  int64_t eval_windows = 64;     // validation windows of `seq` tokens (whole batches of them)
  int64_t checkpoint_every = 0;  // updates between checkpoints; 0 = only at the end
  int64_t stop_after = 0;        // stop (after checkpointing) at this update; 0 = run all
  std::string out_dir = "runs/latest";       // metrics.jsonl, checkpoints, final weights
  std::string out_weights;                   // also write the final weights here
  std::chrono::milliseconds timeout{60000};  // every collective's deadline
  bool overwrite = false;                    // replace another run's results in out_dir
  bool allow_changes = false;  // resume with other hyperparameters than the checkpoint's
  // Failure injection: rank `die_rank` kills itself with SIGKILL as update `die_at_step`
  // starts, as a machine lost mid-run would vanish (0: never). For fault tests and drills.
  int64_t die_at_step = 0;
  int die_rank = 0;
  // Called on every rank once the run's inputs and outputs have been checked, before the first
  // update: what a front end writes into the run directory belongs here, never before, so a
  // refused run leaves the directory as it was. An error stops the run.
  std::function<Status()> on_ready;
  // Called on every rank after every update with what metrics.jsonl records for it.
  std::function<void(const train::StepMetrics&)> on_step;
};

// The ranks a job trains on: `group` for the compute thread and `comm` (a second group over
// the same ranks) for the communication thread. Both null for one process. `pipe`, when set,
// is a third group over the same ranks whose worker sends activations eagerly (job.h); the
// pipeline stages are split from it, else from `group`.
struct TrainRanks {
  std::shared_ptr<comm::Group> group;
  std::shared_ptr<comm::Group> comm;
  std::shared_ptr<comm::Group> pipe;
};

struct TrainSummary {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_val_loss = 0;   // NaN without a validation set
  double unigram_entropy = 0;  // nats per byte of the training text; NaN on batch_file
  double tokens_per_s = 0;
  double seconds = 0;
  double exposed_comm_s = 0;     // summed over the run's steps
  int64_t peak_state_bytes = 0;  // most parameter, gradient and AdamW bytes held at once
};

Result<TrainSummary> train(const TrainOptions& options, const TrainRanks& ranks = {});

// ---- what train() and fault/'s pipeline trainer share ----------------------------------

// The run's model and window: the config of `model_dir`, `config_path` or `preset`, and `seq`
// (the config's max_seq_len when 0). InvalidArgument naming the field for a window longer than
// the model's, or a `batch` or `steps` below 1.
struct RunModel {
  model::ModelConfig config;
  int64_t seq = 0;
};
Result<RunModel> run_model(const TrainOptions& options);

// When the run evaluates, checkpoints and stops (train/run.h), from the options.
train::RunSchedule run_schedule(const TrainOptions& options);

// The whole model a fresh run starts from (`layout`'s flat buffer, into `full`): `model_dir`'s
// weights, `init_weights`, or an initialisation from `seed`.
Status initial_params(const TrainOptions& options, const model::ModelConfig& config,
                      const model::ParamLayout& layout, float* full);

// What a run reads: the corpus's token streams and its validation windows (whole batches of
// the global batch), or the one batch of batch_file. Errors name the field or the file.
struct RunData {
  int64_t batch = 0, seq = 0;  // rows of the global batch (`batch` or the file's), tokens
  std::vector<int64_t> train_stream, val_stream;
  train::Batch fixed;         // the batch file's; empty without one
  train::Batch sft_examples;  // sft_path's training rows; empty without
  std::vector<train::Batch> val_batches;
  double unigram_entropy = 0;  // nats per byte of the training text; NaN on a batch file
  bool fixed_batch() const { return fixed.batch > 0; }
};
Result<RunData> load_run_data(const TrainOptions& options, const model::ModelConfig& config,
                              int64_t seq);

// The end of a run: the whole model gathered (collective over the job), and on rank 0
// config.json and model.safetensors in out_dir, out_weights, and out_dir/hf (below).
Status write_model_outputs(const TrainOptions& options, DataParallel& dp);

// `params` (ParamLayout(config)'s flat buffer) as a Hugging Face checkpoint in out_dir/hf, as
// the family it is (model/hf_checkpoint.h), with the tokenizer and generation files of the
// checkpoint it started from (`from_dir`), or else the byte tokenizer's BOS and EOS in its
// generation_config.json, and the files beside `tokenizer` (a tokenizer.json given on its own,
// which win); nothing for a config no family matches.
Status write_hf_model(const std::string& out_dir, const model::ModelConfig& config,
                      std::span<const float> params, const std::string& from_dir = "",
                      const std::string& tokenizer = "");

}  // namespace wl::parallel
