// Training checkpoints: everything a run needs to continue bit-exactly.
//
// A checkpoint is a directory:
//   model.safetensors      parameters, f32, DESIGN.md names
//   optimizer.safetensors  AdamW moments "m.<name>" and "v.<name>", f32
//   state.json             {"format": "weightlift-train-checkpoint", "version": 1, "step",
//                           "data_rng": [4 x u64 as strings], "loss_scale", "config": {...}}
// It is written to `<dir>.tmp` and renamed into place, so a crash or a full disk leaves the
// previous checkpoint intact. docs/formats.md describes it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/transformer.h"
#include "weightlift/train/adamw.h"

namespace wl::train {

struct CheckpointState {
  int64_t step = 0;                   // updates done
  std::array<uint64_t, 4> data_rng{}; // the window sampler's Rng state
  double loss_scale = 1.0;
};

Status save_checkpoint(const std::string& dir, const model::Transformer& model,
                       AdamW& optimizer, const CheckpointState& state);

// Loads into an already-constructed model and optimizer of the same config (a different
// config is an error naming the first differing key).
Result<CheckpointState> load_checkpoint(const std::string& dir, model::Transformer& model,
                                        AdamW& optimizer);

}  // namespace wl::train
