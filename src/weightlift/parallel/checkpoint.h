// Training checkpoints for every layout: everything a run needs to continue bit-exactly.
//
// A checkpoint is a directory:
//   rank-<r>-of-<n>.safetensors  data-parallel rank r's own rows (core/shard.h) of every
//                                parameter, "<name>", and of its AdamW moments, "m.<name>"
//                                and "v.<name>", f32, shaped [rows, ...]
//   state.json                   {"format": "weightlift-train-checkpoint", "format_version":
//                                2, "step", "adamw_steps", "data_rng", "loss_scale",
//                                "loss_scale_clean_steps", "config", "layout", "tensors":
//                                {"<name>": {"shape", "pieces": [{"file", "rows": [b, e]}]}}}
// Every rank writes its file into `<dir>.tmp`; once all have (agreed by a sum over the ranks,
// so one rank's full disk fails every rank's save), rank 0 writes state.json and swaps the
// directory into place (core/file_io.h), so a crash leaves the previous checkpoint whole.
//
// Loading asks the rank's DataParallel which rows of which states it needs (all rows where a
// state is whole on it, its own where sharded) and copies each from the pieces that overlap
// it, so a checkpoint written in any layout loads into any other; the same layout reads back
// exactly what was written. An index that lies (rows outside the shape, a piece missing from
// its file or shaped otherwise, rows no piece covers) is DataLoss naming the file and tensor.
// Version 1 checkpoints (model.safetensors + optimizer.safetensors + state.json, one process)
// load as a single piece per tensor. docs/formats.md has both.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/parallel/data_parallel.h"

namespace wl::parallel {

struct TrainState {
  int64_t step = 0;                    // updates done
  std::array<uint64_t, 4> data_rng{};  // the window sampler's Rng state
  double loss_scale = 1.0;             // f16's dynamic loss scale (unused otherwise)
  int64_t loss_scale_clean_steps = 0;  // clean steps since the scale last changed
};

// Collective over the data-parallel ranks.
Status save_checkpoint(const std::string& dir, DataParallel& dp, const TrainState& state);

// Collective as well (every rank reads what it needs). A different model config is an error.
Result<TrainState> load_checkpoint(const std::string& dir, DataParallel& dp);

// The counters of checkpoint `dir`'s state.json (a regular file of at most 64 MiB), read
// without its tensors: what a run checks before it allocates anything (run_guard.h).
Result<TrainState> read_checkpoint_state(const std::string& dir);

}  // namespace wl::parallel
