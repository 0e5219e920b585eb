// `weightlift transfer plan`: the static transfer plan for a job that is not running, made
// offline from paper metadata (paper_metadata.h) and returned as the table format_plan()
// prints (bytes per sender and per receiver) or as the plan's JSON (docs/formats.md,
// "Transfer plan"; its addresses and rkeys are placeholders).
//
// World ranks as a job would number them: trainers first (mesh m holds ranks
// m * mesh_size ..< (m + 1) * mesh_size), then receivers (engine i holds the next tp ranks).
#pragma once

#include <string>

#include "weightlift/core/status.h"

namespace wl::transfer {

struct PlanCommandOptions {
  std::string preset = "medium";    // model/config.h preset name
  int trainers = 2;                 // trainer ranks in all
  int mesh_size = 0;                // FSDP mesh size; 0: one mesh of every trainer
  int receivers = 2;                // receiver ranks in all: receivers / tp inference engines
  int tp = 2;                       // TP degree of each engine; divides receivers and the model
  std::string dtype = "bf16";       // what receivers hold: "bf16" or "fp8"
  std::string shard_dtype = "f32";  // what trainers hold: "f32" or "bf16"
  bool json = false;                // the plan's JSON instead of the table
};

// InvalidArgument for an unknown preset or dtype, counts below 1, a mesh size or TP degree
// that does not divide the trainer or receiver count, or a TP degree the model cannot be
// split by (naming the receiver rank); the planner's own refusals otherwise.
Result<std::string> describe_plan(const PlanCommandOptions& options);

}  // namespace wl::transfer
