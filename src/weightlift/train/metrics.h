// What a training run reports after every update, and `metrics.jsonl`, the file that keeps
// it: one JSON object per update (docs/formats.md, "Training metrics"). The trainer appends a
// record after each update and continues the file when it resumes; `weightlift train` draws
// its progress bar from the same values and its loss plot from the file.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::train {

struct StepMetrics {
  int64_t step = 0;  // updates done, this one included
  double loss = 0;   // ce + aux + z of the update's micro-batches
  double ce = 0, aux = 0, z = 0;
  double lr = 0;            // the rate this update used
  double grad_norm = 0;     // global norm before clipping
  bool skipped = false;     // f16 overflow: the update was not applied
  double loss_scale = NAN;  // f16's dynamic loss scale; NaN in other precisions
  double tokens_per_s = 0;  // since this run (or this resume) started
  double elapsed_s = 0;     // likewise
  double val_loss = NAN;    // NaN where no validation pass ran
  // The share of routing slots dropped over expert capacity (the config's capacity_factor)
  // in this update; NaN when routing is dropless.
  double drop_rate = NAN;
};

// drop_rate for `dropped` of `slots` routing slots under `capacity_factor` (NaN when unset).
double drop_rate(const std::optional<double>& capacity_factor, int64_t slots, int64_t dropped);

// One metrics.jsonl line (without the newline).
std::string metrics_to_json(const StepMetrics& m);

// The records of `path`, in order. A last line cut short (the run was killed mid-write) is
// dropped; any other line that is not a metrics record is DataLoss naming the file and line.
// No file: no records.
Result<std::vector<StepMetrics>> read_metrics(const std::string& path);

}  // namespace wl::train
