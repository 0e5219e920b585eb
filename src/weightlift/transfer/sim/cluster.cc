// simulate_cluster (cluster.h): options -> schedule input -> loads -> prediction, and the
// sensitivity table.
#include "weightlift/transfer/sim/cluster.h"

#include <cstdio>

#include "weightlift/core/memory_budget.h"
#include "weightlift/core/timing.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"

namespace wl::transfer {
namespace {

std::string opt(const char* name, double v) {
  char b[96];
  std::snprintf(b, sizeof b, "%s %g", name, v);
  return b;
}

// One schedule and its prediction; `stage` names it to the progress callback.
Result<Simulation> run(const ClusterOptions& o, const std::string& stage) {
  WL_ASSIGN_OR_RETURN(ScheduleInput in, cluster_schedule_input(o));
  if (o.progress) in.progress = [&](double f) { o.progress(stage, f); };
  const Stopwatch clock;
  WL_ASSIGN_OR_RETURN(ScheduleLoads loads, schedule_loads(in));
  Simulation r{.loads = std::move(loads)};
  r.schedule_seconds = clock.seconds();
  r.prediction = predict(r.loads, o.network);
  return r;
}

// A layout assumption halved and doubled: a new schedule each (invalid layouts are marked).
Sensitivity layout_row(const ClusterOptions& o, const char* name, int ClusterOptions::*field) {
  Sensitivity s{.name = name, .base = double(o.*field)};
  s.half = double(o.*field / 2);
  s.twice = double(o.*field * 2);
  for (bool half : {true, false}) {
    if (half && o.*field % 2 != 0) {
      s.valid = false;
      continue;
    }
    ClusterOptions v = o;
    v.*field = half ? o.*field / 2 : o.*field * 2;
    auto r = run(v, "`" + std::string(name) + (half ? "` x0.5" : "` x2"));
    if (!r.ok()) {
      s.valid = false;
      continue;
    }
    (half ? s.half_seconds : s.twice_seconds) = r->prediction.seconds;
  }
  return s;
}

// Counts, divisibility, dtype and network figures, each refusal naming its option.
Status check_cluster(const ClusterOptions& o) {
  const std::string w = "transfer simulate: ";
  for (auto [name, v] : {std::pair<const char*, int>{"`trainers`", o.trainers},
                         {"`receivers`", o.receivers},
                         {"`gpus_per_node`", o.gpus_per_node},
                         {"`engine_gpus`", o.engine_gpus},
                         {"`dense_mesh`", o.dense_mesh}}) {
    if (v < 1) return invalid_argument(w + name + " " + std::to_string(v) + ": needs at least 1");
  }
  if (o.expert_mesh < 0) {
    return invalid_argument(w + "`expert_mesh` " + std::to_string(o.expert_mesh) +
                            ": needs 0 (experts as dense) or more");
  }
  auto multiple = [&](const char* a, int av, const char* b, int bv) -> Status {
    if (av % bv == 0) return ok_status();
    return invalid_argument(w + a + " " + std::to_string(av) + " is not a multiple of " + b + " " +
                            std::to_string(bv));
  };
  WL_RETURN_IF_ERROR(multiple("`receivers`", o.receivers, "`gpus_per_node`", o.gpus_per_node));
  WL_RETURN_IF_ERROR(multiple("`receivers`", o.receivers, "`engine_gpus`", o.engine_gpus));
  WL_RETURN_IF_ERROR(multiple("`trainers`", o.trainers, "`gpus_per_node`", o.gpus_per_node));
  WL_RETURN_IF_ERROR(multiple("`trainers`", o.trainers, "`dense_mesh`", o.dense_mesh));
  if (o.expert_mesh > 0) {
    WL_RETURN_IF_ERROR(multiple("`trainers`", o.trainers, "`expert_mesh`", o.expert_mesh));
  }
  if (o.network.gpus_per_nic < 1) {
    return invalid_argument(w + "`gpus_per_nic` " + std::to_string(o.network.gpus_per_nic) +
                            ": needs at least 1");
  }
  WL_RETURN_IF_ERROR(
      multiple("`gpus_per_node`", o.gpus_per_node, "`gpus_per_nic`", o.network.gpus_per_nic));
  if (o.shard_dtype != DType::kBF16 && o.shard_dtype != DType::kF32) {
    return invalid_argument(w + "`shard_dtype` " + std::string(dtype_name(o.shard_dtype)) +
                            " is neither bf16 nor f32");
  }
  const NetworkModel& n = o.network;
  for (auto [name, v] : {std::pair<const char*, double>{"`nic_gbps`", n.nic_gbps},
                         {"`nvlink_gbps`", n.nvlink_gbps},
                         {"`prepare_gbs`", n.prepare_gbs}}) {
    if (!(v > 0)) return invalid_argument(w + opt(name, v) + ": must be positive");
  }
  for (auto [name, v] :
       {std::pair<const char*, double>{"`message_overhead_us`", n.message_overhead_us},
        {"`barrier_ms`", n.barrier_ms},
        {"`maxima_ms`", n.maxima_ms}}) {
    if (!(v >= 0)) return invalid_argument(w + opt(name, v) + ": must not be negative");
  }
  return ok_status();
}

// Placement 0: the dense FSDP meshes; then one placement per expert-parallel position.
void add_placements(const ClusterOptions& o, ScheduleInput& in) {
  Placement dense;
  for (int m = 0; m < o.trainers / o.dense_mesh; ++m) {
    std::vector<int>& mesh = dense.meshes.emplace_back();
    for (int k = 0; k < o.dense_mesh; ++k) mesh.push_back(m * o.dense_mesh + k);
  }
  in.placements.push_back(std::move(dense));
  const int positions = o.expert_mesh > 0 ? o.trainers / o.expert_mesh : 0;
  for (int p = 0; p < positions; ++p) {
    Placement pl;
    std::vector<int>& mesh = pl.meshes.emplace_back();
    for (int j = 0; j < o.expert_mesh; ++j) mesh.push_back(p + j * positions);
    in.placements.push_back(std::move(pl));
  }
}

// What a simulation holds at least, checked before it is built: one receiver layout per
// engine rank (each of `tensors` tensors with its sources), the per-rank state of the
// schedule, and the sensitivity table's reschedules with the engine and the trainers doubled.
Status check_simulation_memory(const ClusterOptions& o, size_t tensors) {
  constexpr uint64_t kTensorBytes = sizeof(ReceiverTensor) + sizeof(SourceSlice) + 96;
  // Per rank (trainer or receiver): both phases' counters and the schedule's tables, which
  // hold a few bytes per tensor for every rank (family membership). Measured, not derived
  // (peak RSS between two sizes, 2026-11-25): 18 KB per added rank for Kimi-K2's 6,799
  // tensors (1,024 + 1,024 -> 2,048 + 2,048 ranks: 118 -> 156 MB), 0.5 KB for tiny's 49
  // (4,096 + 4,096 -> 16,384 + 16,384: 13.7 -> 25.8 MB). 256 B + 2 B per tensor stays below
  // both. Without this term, 2^20 + 2^20 Kimi-K2 ranks were estimated at 545 MB and grew past
  // 10 GB before they were killed.
  const uint64_t rank_bytes = add_sat(256, mul_sat(2, tensors));
  const uint64_t layouts = mul_sat(mul_sat(uint64_t(o.engine_gpus), tensors), kTensorBytes);
  const uint64_t loads = mul_sat(add_sat(uint64_t(o.trainers), uint64_t(o.receivers)), rank_bytes);
  const uint64_t once = add_sat(layouts, loads);
  return check_memory(
      o.sensitivity ? mul_sat(once, 2) : once,
      "simulating " + std::to_string(o.trainers) + " trainers and " + std::to_string(o.receivers) +
          " receivers",
      format_bytes(layouts) + " of receiver layouts of " + std::to_string(tensors) +
          " tensors for `engine_gpus` " + std::to_string(o.engine_gpus) + ", " +
          format_bytes(loads) + " of per-rank schedule state" +
          (o.sensitivity ? ", twice for the sensitivity table's doubled layouts" : ""));
}

// The model's parameters on their placements and one receiver layout per engine rank.
Status add_model(const ClusterOptions& o, const model::ModelConfig* preset, ScheduleInput& in) {
  const int positions = int(in.placements.size()) - 1;
  auto placement = [&](int64_t expert, int64_t experts) {
    return expert < 0 || positions == 0 ? 0 : 1 + int(expert * positions / experts);
  };
  auto add_param = [&](std::string name, const Shape& shape, int64_t expert, int64_t experts) {
    const int64_t cols = shape.size() == 2 ? shape[1] : 1;
    in.params.push_back({std::move(name), shape[0], cols, placement(expert, experts)});
  };
  if (preset == nullptr) {
    for (K2Param& p : k2_params(o.k2))
      add_param(std::move(p.name), p.shape, p.expert_index, o.k2.num_experts);
  } else {
    const model::ParamLayout layout(*preset);
    for (const model::ParamInfo& p : layout.params()) {
      add_param(p.name, p.shape, p.expert, preset->num_experts);
    }
  }
  for (int r = 0; r < o.engine_gpus; ++r) {
    if (r == 1) WL_RETURN_IF_ERROR(check_simulation_memory(o, in.layouts[0].size()));
    auto lay =
        preset == nullptr
            ? k2_inference_layout(o.k2,
                                  {.engine_gpus = o.engine_gpus, .rank = r, .format = o.format})
            : inference_layout(*preset, {.tp = o.engine_gpus, .tp_rank = r, .format = o.format});
    if (!lay.ok()) {
      return lay.status().with_context("transfer simulate `engine_gpus` " +
                                       std::to_string(o.engine_gpus) + " (rank " +
                                       std::to_string(r) + ")");
    }
    in.layouts.push_back(std::move(*lay));
  }
  if (o.engine_gpus == 1) WL_RETURN_IF_ERROR(check_simulation_memory(o, in.layouts[0].size()));
  for (int r = 0; r < o.receivers; ++r) in.receiver_layout.push_back(r % o.engine_gpus);
  return ok_status();
}

}  // namespace

Result<ScheduleInput> cluster_schedule_input(const ClusterOptions& o) {
  const bool k2 = o.model == "kimi-k2";
  Result<model::ModelConfig> config = model::preset(o.model);
  if (!k2 && !config.ok()) {
    std::string names = "kimi-k2";
    for (const std::string& n : model::preset_names()) names += ", " + n;
    return invalid_argument("transfer simulate: `model` '" + o.model + "' is not one of " + names);
  }
  WL_RETURN_IF_ERROR(check_cluster(o));
  ScheduleInput in{.trainers = o.trainers, .trainer_dtype = o.shard_dtype};
  add_placements(o, in);
  WL_RETURN_IF_ERROR(add_model(o, k2 ? nullptr : &*config, in));
  return in;
}

Result<int64_t> cluster_param_count(const ClusterOptions& o) {
  if (o.model == "kimi-k2") return k2_param_count(o.k2);
  WL_ASSIGN_OR_RETURN(model::ModelConfig c, model::preset(o.model));
  return model::ParamLayout(c).total();
}

Result<Simulation> simulate_cluster(const ClusterOptions& o) {
  WL_ASSIGN_OR_RETURN(Simulation s, run(o, "schedule"));
  WL_ASSIGN_OR_RETURN(s.params, cluster_param_count(o));
  if (o.sensitivity) {
    s.sensitivity = network_sensitivity(s.loads, o.network);
    s.sensitivity.push_back(layout_row(o, "engine_gpus", &ClusterOptions::engine_gpus));
    s.sensitivity.push_back(layout_row(o, "trainers", &ClusterOptions::trainers));
  }
  s.dominant = dominant_assumption(s.sensitivity, s.prediction.seconds);
  const int engines = o.receivers / o.engine_gpus;
  s.replica_bytes = s.prediction.total_bytes / uint64_t(engines);
  s.broadcast_bound_s = broadcast_bound_seconds(s.replica_bytes, o.gpus_per_node, o.network);
  return s;
}

}  // namespace wl::transfer
