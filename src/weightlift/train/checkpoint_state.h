// state.json, the part of a training checkpoint that is not tensors (docs/formats.md,
// "Training checkpoints"), format version 4:
//
//   {"format": "weightlift-train-checkpoint", "format_version": 4,
//    "step", "adamw_steps", "data_rng": [4 x u64 as strings], "loss_scale",
//    "loss_scale_clean_steps", "config": {...}, "layout": {...}, "run": {"steps": "600", ...},
//    "tensors": {"<name>": {"shape", "pieces": [{"file", "rows": [b, e], "cols": [b, e]}]}},
//    "files": {"rank-00000-of-00002.safetensors": "<16 hex digits>", ...},
//    "state_checksum": "<16 hex digits>"}
//
// Checksums are XXH3-64 (core/checksum.h). Each tensor file carries, in its safetensors
// metadata, the checksum of each of its tensors' bytes under "xxh3.<tensor name>";
// "files" holds, per file, the checksum of those entries (tensor_file_digest), which ties
// every file to this state; state_checksum is of this file's own bytes with its 16 digits
// written as zeros, so any byte that changes after writing is caught, however the JSON would
// be re-serialised. Parsing checks every field's type and range (steps not negative, the
// AdamW count not beyond the step, a loss scale in [1, 2^100], a data RNG that is not all
// zero): what a resumed run can trust before it reads any tensor. parallel/run/checkpoint.h
// writes and reads the tensors.
//
// Version 4 added "cols", a piece's band of columns (a tensor-parallel rank's o_proj or
// down_proj), written only when the band is not every column: version 3 is version 4 with
// no such pieces, and is read as it is. Builds that read version 3 refuse version 4, rather
// than read a band of columns as whole rows.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "weightlift/core/json_record.h"
#include "weightlift/core/status.h"

namespace wl::train {

struct CheckpointState {
  int64_t step = 0;                    // updates done
  std::array<uint64_t, 4> data_rng{};  // the window sampler's Rng state
  double loss_scale = 1.0;             // f16's dynamic loss scale (unused otherwise)
  int64_t loss_scale_clean_steps = 0;  // clean steps since the scale last changed
  // The run's hyperparameters by flag name ("steps" -> "600", "lr" -> "0.003"): a resume
  // that changes one is refused naming it (parallel/run/run_guard.h).
  std::map<std::string, std::string> run;
};

// Everything state.json holds.
struct StateFile {
  CheckpointState state;
  int64_t adamw_steps = 0;
  std::string config_json;  // the model's config.json, canonical (config_to_json)
  nlohmann::json layout;    // where it was written: {"dp", "pp", "ep", "tp", "dp_mode",
                            // "micro_batches"}
  nlohmann::json tensors;   // the index: name -> {"shape", "pieces": [{"file", "rows", "cols"}]}
  std::map<std::string, uint64_t> files;  // tensor file -> tensor_file_digest of it
};

inline constexpr RecordFormat kCheckpointStateFormat{
    .name = "weightlift-train-checkpoint",
    .version = 4,
    .what = "training checkpoint state",
    .remedy = "resume it with the weightlift that wrote it"};

// The file's text, state_checksum included.
std::string state_to_json(const StateFile& state);

// DataLoss naming `where` and the field for anything malformed or a checksum that does not
// match; FailedPrecondition for another format version than 3 or 4 (versions 1 and 2
// carried no checksums and cannot be verified).
Result<StateFile> state_from_json(std::string_view text, std::string_view where);

// `text` with its state_checksum recomputed: what the writer does last, and what a test or a
// fuzzer does to a state it edited on purpose. Unchanged if it holds no state_checksum.
std::string seal_state_text(std::string text);
// OK when `text` (parsed as `j`) carries "state_checksum" once, where seal_state_text writes
// it, and the checksum matches; DataLoss naming `where` otherwise. Other files sealed the same
// way (an RL run's rl_state.json) check themselves with it.
Status verify_sealed_text(std::string_view text, const nlohmann::json& j, const std::string& where);

// The metadata key of tensor `name`'s checksum in a tensor file: "xxh3.<name>".
std::string tensor_checksum_key(std::string_view name);
// What "files" records of a tensor file: XXH3-64 of its "<name> <16 hex digits>\n" lines, in
// name order, one per tensor.
uint64_t tensor_file_digest(const std::map<std::string, uint64_t>& checksums);

}  // namespace wl::train
