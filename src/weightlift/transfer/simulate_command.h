// `weightlift transfer simulate`: the planner's schedule at cluster scale (schedule_loads.h)
// timed by the network model (simulate.h), for Kimi-K2's shapes (kimi_k2.h) or one of our
// presets, with a sensitivity table: each assumption halved and doubled, so which one
// dominates is measured. docs/simulate.md has the model, the assumptions and the K2 result.
//
// Ranks, as a job would place them: trainer t on node t / gpus_per_node; receivers on their
// own nodes, instance i holding receivers [i * instance_gpus, (i + 1) * instance_gpus).
// Trainer layout (seed 000, "DeviceMesh and Mesh Groups"): the dense weights are FSDP-sharded
// over meshes of `dense_mesh` consecutive ranks (one node at 8: the gathers use NVLink),
// replicated over trainers / dense_mesh meshes (HSDP); the routed experts are expert
// parallel over trainers / expert_mesh positions, position p a mesh of ranks p, p + P, ...
// (on different nodes, as the seed's expert meshes are), expert e of every layer on position
// e * P / E. expert_mesh 0: experts sharded like the dense weights (pure FSDP, the layout
// `weightlift transfer plan` uses). Receivers: kimi_k2.h's layout (dense TP, experts EP over
// the instance) or, for a preset, inference_layout.h's (TP over the instance).
#pragma once

#include <functional>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/transfer/kimi_k2.h"
#include "weightlift/transfer/schedule_loads.h"
#include "weightlift/transfer/simulate.h"

namespace wl::transfer {

struct SimulateOptions {
  std::string model = "kimi-k2";     // "kimi-k2" or a model/config.h preset
  K2Shapes k2;                       // the shapes "kimi-k2" means (tests shrink them)
  int trainers = 256;                // trainer GPUs (seed 000: 256)
  int receivers = 128;               // inference GPUs (seed 000: 128)
  int gpus_per_node = 8;             // for both sides
  int instance_gpus = 16;            // GPUs per inference instance: its TP (and EP) degree
  int dense_mesh = 8;                // trainer FSDP mesh of the dense weights
  int expert_mesh = 2;               // trainer mesh of one expert-parallel position; 0: as dense
  std::string dtype = "fp8";         // what receivers hold: fp8 or bf16
  std::string shard_dtype = "bf16";  // what trainers hold: bf16 or f32
  NetworkModel network;
  bool sensitivity = true;  // the halve/double table (reschedules for layout rows)
  bool json = false;        // one JSON object instead of the report
  // Called with a stage ("schedule") and its fraction done; may be null.
  std::function<void(const std::string&, double)> progress;
};

// The schedule's input for `options`; InvalidArgument naming the option at fault: an unknown
// model, a count below 1, receivers not a multiple of gpus_per_node or instance_gpus,
// trainers not a multiple of gpus_per_node or a mesh size, an unknown dtype, a network figure
// that is not positive, an instance size the model cannot be split by.
Result<ScheduleInput> simulation_input(const SimulateOptions& options);

// Parameters the chosen model has (Kimi-K2: k2_param_count; a preset: ParamLayout::total).
Result<int64_t> simulation_param_count(const SimulateOptions& options);

// Validates, schedules, predicts, and returns the report or its JSON.
Result<std::string> simulate_transfer(const SimulateOptions& options);

}  // namespace wl::transfer
