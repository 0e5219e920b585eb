// The one training run: what every trainer does around its updates, whatever computes them
// (parallel/run/trainer.h on a layout of ranks, fault/trainer.h on a pipeline that loses
// stages, rl/'s trainer on a policy). Where its outputs go and who may write there; when it
// evaluates, checkpoints and stops; its records streamed to a JSONL file as each step ends, and
// kept through a resume or a rollback; its throughput. It prints nothing: each front end draws
// its progress from the records it is handed (the trainers' on_step).
#pragma once

#include <cstdint>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "weightlift/core/file_io.h"
#include "weightlift/core/status.h"
#include "weightlift/core/timing.h"
#include "weightlift/train/metrics.h"

namespace wl::train {

// When a run evaluates, checkpoints and stops. Steps count from 1 (the first update is step 1).
struct RunSchedule {
  int64_t steps = 0;             // the run's length
  int64_t eval_every = 0;        // steps between evaluations; 0: at the end only
  int64_t checkpoint_every = 0;  // steps between checkpoints; 0: none but the trainer's own
  int64_t stop_after = 0;        // stop at this step (a run cut in two); 0: run all

  // The step this process stops after: `steps`, or `stop_after` when it comes first.
  int64_t last_step() const;
  bool evaluates_at(int64_t step) const;
  bool checkpoints_at(int64_t step) const;
};

// `out_dir/checkpoint-STEP`, where every trainer keeps the checkpoint of a step.
std::string checkpoint_dir(const std::string& out_dir, int64_t step);

// The run's output directory, created and held by its writer for the whole run (DirectoryLock:
// no other run writes there meanwhile, and its stale staging is swept). `field` names the
// option in errors.
Result<DirectoryLock> hold_out_dir(const std::string& out_dir, std::string_view field);

// A run's records, one JSON object per line, each appended and flushed as its step ends: a long
// run can be followed as it goes, and a crash keeps every step that finished.
class RecordLog {
 public:
  // Starts `path` with `lines` (a resumed run's earlier records, or none), written through a
  // temporary file so an error leaves the old file as it was; appends from there.
  Status open(const std::string& path, std::span<const std::string> lines);
  Status append(const std::string& line);
  bool is_open() const { return out_.is_open(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// `log` (re)opened on the metrics.jsonl at `path` with its records through step `keep_through`:
// a run that went past it (killed after a later step, or rolled back) wrote steps about to be
// done again. Returns the records kept.
Result<std::vector<StepMetrics>> continue_metrics(RecordLog& log, const std::string& path,
                                                  int64_t keep_through);

// Tokens trained since the run (or its resume) started, against the wall clock.
class Throughput {
 public:
  void restart() {
    clock_.restart();
    tokens_ = 0;
  }
  void add(int64_t tokens) { tokens_ += tokens; }
  double seconds() const { return clock_.seconds(); }
  double tokens_per_s() const;
  // The record's elapsed_s and tokens_per_s, as of now.
  void stamp(StepMetrics& m) const;

 private:
  Stopwatch clock_;
  int64_t tokens_ = 0;
};

}  // namespace wl::train
