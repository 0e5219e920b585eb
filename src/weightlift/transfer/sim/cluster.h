// A weight update simulated on a cluster: the planner's schedule at cluster scale
// (load_schedule.h) timed by the network model (network_model.h), for Kimi-K2's shapes
// (kimi_k2.h) or one of our presets, with a sensitivity table: each assumption halved and
// doubled, so which one dominates is measured. docs/simulate.md has the model, the assumptions
// and the K2 result; `weightlift transfer simulate` prints it.
//
// Ranks, as a job would place them: trainer t on node t / gpus_per_node; receivers on their
// own nodes, engine i holding receivers [i * engine_gpus, (i + 1) * engine_gpus).
// Trainer layout (seed 000, "DeviceMesh and Mesh Groups"): the dense weights are FSDP-sharded
// over meshes of `dense_mesh` consecutive ranks (one node at 8),
// replicated over trainers / dense_mesh meshes (HSDP); the routed experts are expert
// parallel over trainers / expert_mesh positions, position p a mesh of ranks p, p + P, ...
// (on different nodes, as the seed's expert meshes are), expert e of every layer on position
// e * P / E. expert_mesh 0: experts sharded like the dense weights (pure FSDP, the layout
// `weightlift transfer plan` uses). Receivers: kimi_k2.h's layout (dense TP, experts EP over
// the engine) or, for a preset, layout/inference_layout.h's (TP over the engine).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/transfer/sim/kimi_k2.h"
#include "weightlift/transfer/sim/load_schedule.h"
#include "weightlift/transfer/sim/network_model.h"

namespace wl::transfer {

struct ClusterOptions {
  std::string model = "kimi-k2";  // "kimi-k2" or a model/config.h preset
  K2Shapes k2;                    // the shapes "kimi-k2" means (tests shrink them)
  int trainers = 256;             // trainer GPUs (seed 000: 256)
  int receivers = 128;            // inference GPUs (seed 000: 128)
  int gpus_per_node = 8;          // for both sides
  int engine_gpus = 16;           // GPUs per inference engine: its TP (and EP) degree
  int dense_mesh = 8;             // trainer FSDP mesh of the dense weights
  int expert_mesh = 2;            // trainer mesh of one expert-parallel position; 0: as dense
  WeightFormat format = WeightFormat::kFP8;  // what receivers hold
  DType shard_dtype = DType::kBF16;          // what trainers hold: kBF16 or kF32
  NetworkModel network;
  bool sensitivity = true;  // the halve/double table (reschedules for layout rows)
  // Called with a stage ("schedule", "`trainers` x2", ...) and its fraction done; may be null.
  std::function<void(const std::string&, double)> progress;
};

struct Simulation {
  int64_t params = 0;  // parameters of the model
  ScheduleLoads loads;
  Prediction prediction;
  double schedule_seconds = 0;           // how long scheduling took here (wall time)
  uint64_t replica_bytes = 0;            // what one engine holds in all
  double broadcast_bound_s = 0;          // checkpoint-engine's broadcast at best (network_model.h)
  std::vector<Sensitivity> sensitivity;  // empty unless asked for
  int dominant = -1;                     // index into sensitivity, or -1
};

// The schedule's input for `options`; InvalidArgument naming the option at fault: an unknown
// model, a count below 1, receivers not a multiple of gpus_per_node or engine_gpus,
// trainers not a multiple of gpus_per_node or a mesh size, a shard dtype other than bf16 or
// f32, a network figure that is not positive, an engine size the model cannot be split by.
Result<ScheduleInput> cluster_schedule_input(const ClusterOptions& options);

// Parameters the chosen model has (Kimi-K2: k2_param_count; a preset: ParamLayout::total).
Result<int64_t> cluster_param_count(const ClusterOptions& options);

// Validates, schedules, predicts and, if asked, reschedules for the sensitivity table.
Result<Simulation> simulate_cluster(const ClusterOptions& options);

}  // namespace wl::transfer
