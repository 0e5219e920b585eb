// Training checkpoints: everything a run needs to continue bit-exactly.
//
// A checkpoint is a directory:
//   model.safetensors      parameters, f32, DESIGN.md names
//   optimizer.safetensors  AdamW moments "m.<name>" and "v.<name>", f32
//   state.json             {"format": "weightlift-train-checkpoint", "version": 1, "step",
//                           "data_rng": [4 x u64 as strings], "loss_scale",
//                           "loss_scale_clean_steps", "config": {...}}
// It is written to `<dir>.tmp` and swapped into place (core/file_io.h replace_directory), so
// a crash or a full disk leaves a complete checkpoint behind. docs/formats.md describes it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/transformer.h"
#include "weightlift/train/adamw.h"

namespace wl::train {

struct CheckpointState {
  int64_t step = 0;                    // updates done
  std::array<uint64_t, 4> data_rng{};  // the window sampler's Rng state
  double loss_scale = 1.0;             // f16's dynamic loss scale (unused otherwise)
  int64_t loss_scale_clean_steps = 0;  // clean steps since the scale last changed
};

Status save_checkpoint(const std::string& dir, const model::Transformer& model, AdamW& optimizer,
                       const CheckpointState& state);

// Loads into an already-constructed model and optimizer of the same config (a different
// config is an error naming the first differing key).
Result<CheckpointState> load_checkpoint(const std::string& dir, model::Transformer& model,
                                        AdamW& optimizer);

}  // namespace wl::train
