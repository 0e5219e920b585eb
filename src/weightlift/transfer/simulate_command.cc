// simulate_transfer: options -> schedule input -> loads -> prediction, sensitivity, report.
#include "weightlift/transfer/simulate_command.h"

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weightlift/model/config.h"
#include "weightlift/model/params.h"

namespace wl::transfer {
namespace {

using nlohmann::json;

std::string opt(const char* name, double v) {
  char b[96];
  std::snprintf(b, sizeof b, "%s %g", name, v);
  return b;
}

// "layers.3.moe.experts.17.up_proj.weight" -> 17; -1 for a dense parameter.
int64_t preset_expert_index(const std::string& name) {
  const std::string key = ".moe.experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) return -1;
  return std::stoll(name.substr(at + key.size()));
}

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", bytes / 1e9);
  return b;
}

std::string secs(double s) {
  char b[32];
  if (s < 0.01) {
    std::snprintf(b, sizeof b, "%.2f ms", s * 1e3);
  } else {
    std::snprintf(b, sizeof b, "%.3f s", s);
  }
  return b;
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return out;
}

struct Run {
  ScheduleLoads loads;
  Prediction prediction;
  double schedule_seconds = 0;
};

Result<Run> run(const SimulateOptions& o, const std::string& stage) {
  WL_ASSIGN_OR_RETURN(ScheduleInput in, simulation_input(o));
  if (o.progress) in.progress = [&](double f) { o.progress(stage, f); };
  const auto t0 = std::chrono::steady_clock::now();
  WL_ASSIGN_OR_RETURN(ScheduleLoads loads, schedule_loads(in));
  Run r{.loads = std::move(loads)};
  r.schedule_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.prediction = predict(r.loads, o.network);
  return r;
}

// A layout assumption halved and doubled: a new schedule each (invalid layouts are marked).
Sensitivity layout_row(const SimulateOptions& o, const char* name, int SimulateOptions::*field) {
  Sensitivity s{.name = name, .base = double(o.*field)};
  s.half = double(o.*field / 2);
  s.twice = double(o.*field * 2);
  for (bool half : {true, false}) {
    if (half && o.*field % 2 != 0) {
      s.valid = false;
      continue;
    }
    SimulateOptions v = o;
    v.*field = half ? o.*field / 2 : o.*field * 2;
    auto r = run(v, std::string(name) + (half ? " x0.5" : " x2"));
    if (!r.ok()) {
      s.valid = false;
      continue;
    }
    (half ? s.half_seconds : s.twice_seconds) = r->prediction.seconds;
  }
  return s;
}

}  // namespace

Result<ScheduleInput> simulation_input(const SimulateOptions& o) {
  const std::string w = "transfer simulate: ";
  const bool k2 = o.model == "kimi-k2";
  Result<model::ModelConfig> config = model::preset(o.model);
  if (!k2 && !config.ok()) {
    std::string names = "kimi-k2";
    for (const std::string& n : model::preset_names()) names += ", " + n;
    return invalid_argument(w + "--model '" + o.model + "' is not one of " + names);
  }
  for (auto [name, v] : {std::pair<const char*, int>{"--trainers", o.trainers},
                         {"--receivers", o.receivers},
                         {"--gpus-per-node", o.gpus_per_node},
                         {"--instance-gpus", o.instance_gpus},
                         {"--dense-mesh", o.dense_mesh}}) {
    if (v < 1) return invalid_argument(w + name + " " + std::to_string(v) + ": needs at least 1");
  }
  if (o.expert_mesh < 0) {
    return invalid_argument(w + "--expert-mesh " + std::to_string(o.expert_mesh) +
                            ": needs 0 (experts as dense) or more");
  }
  auto multiple = [&](const char* a, int av, const char* b, int bv) -> Status {
    if (av % bv == 0) return ok_status();
    return invalid_argument(w + a + " " + std::to_string(av) + " is not a multiple of " + b + " " +
                            std::to_string(bv));
  };
  WL_RETURN_IF_ERROR(multiple("--receivers", o.receivers, "--gpus-per-node", o.gpus_per_node));
  WL_RETURN_IF_ERROR(multiple("--receivers", o.receivers, "--instance-gpus", o.instance_gpus));
  WL_RETURN_IF_ERROR(multiple("--trainers", o.trainers, "--gpus-per-node", o.gpus_per_node));
  WL_RETURN_IF_ERROR(multiple("--trainers", o.trainers, "--dense-mesh", o.dense_mesh));
  if (o.expert_mesh > 0) {
    WL_RETURN_IF_ERROR(multiple("--trainers", o.trainers, "--expert-mesh", o.expert_mesh));
  }
  const std::optional<WeightFormat> format = weight_format_from_name(o.dtype);
  if (!format) return invalid_argument(w + "--dtype '" + o.dtype + "' is neither fp8 nor bf16");
  DType shard = DType::kBF16;
  if (o.shard_dtype == "f32") {
    shard = DType::kF32;
  } else if (o.shard_dtype != "bf16") {
    return invalid_argument(w + "--shard-dtype '" + o.shard_dtype + "' is neither bf16 nor f32");
  }
  const NetworkModel& n = o.network;
  for (auto [name, v] : {std::pair<const char*, double>{"--nic-gbps", n.nic_gbps},
                         {"--nvlink-gbps", n.nvlink_gbps},
                         {"--prepare-gbs", n.prepare_gbs}}) {
    if (!(v > 0)) return invalid_argument(w + opt(name, v) + ": must be positive");
  }
  for (auto [name, v] :
       {std::pair<const char*, double>{"--message-overhead-us", n.message_overhead_us},
        {"--barrier-ms", n.barrier_ms}}) {
    if (!(v >= 0)) return invalid_argument(w + opt(name, v) + ": must not be negative");
  }

  ScheduleInput in{
      .trainers = o.trainers, .gpus_per_node = o.gpus_per_node, .trainer_dtype = shard};
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
  auto placement = [&](int64_t expert, int64_t experts) {
    return expert < 0 || positions == 0 ? 0 : 1 + int(expert * positions / experts);
  };
  auto where = [&](int rank) {
    return "transfer simulate --instance-gpus " + std::to_string(o.instance_gpus) + " (rank " +
           std::to_string(rank) + ")";
  };
  if (k2) {
    for (K2Param& p : k2_params(o.k2)) {
      const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
      in.params.push_back(
          {std::move(p.name), p.shape[0], cols, placement(p.expert_index, o.k2.num_experts)});
    }
    for (int r = 0; r < o.instance_gpus; ++r) {
      auto lay = k2_inference_layout(
          o.k2, {.instance_gpus = o.instance_gpus, .rank = r, .format = *format});
      if (!lay.ok()) return lay.status().with_context(where(r));
      in.layouts.push_back(std::move(*lay));
    }
  } else {
    const model::ParamLayout layout(*config);
    for (const model::ParamInfo& p : layout.params()) {
      const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
      in.params.push_back(
          {p.name, p.shape[0], cols, placement(preset_expert_index(p.name), config->num_experts)});
    }
    for (int r = 0; r < o.instance_gpus; ++r) {
      auto lay =
          inference_layout(*config, {.tp = o.instance_gpus, .tp_rank = r, .format = *format});
      if (!lay.ok()) return lay.status().with_context(where(r));
      in.layouts.push_back(std::move(*lay));
    }
  }
  for (int r = 0; r < o.receivers; ++r) in.receiver_layout.push_back(r % o.instance_gpus);
  return in;
}

Result<int64_t> simulation_param_count(const SimulateOptions& o) {
  if (o.model == "kimi-k2") return k2_param_count(o.k2);
  WL_ASSIGN_OR_RETURN(model::ModelConfig c, model::preset(o.model));
  return model::ParamLayout(c).total();
}

Result<std::string> simulate_transfer(const SimulateOptions& o) {
  WL_ASSIGN_OR_RETURN(Run base, run(o, "schedule"));
  WL_ASSIGN_OR_RETURN(int64_t params, simulation_param_count(o));
  const Prediction& p = base.prediction;
  std::vector<Sensitivity> rows;
  if (o.sensitivity) {
    rows = network_sensitivity(base.loads, o.network);
    rows.push_back(layout_row(o, "--instance-gpus", &SimulateOptions::instance_gpus));
    rows.push_back(layout_row(o, "--trainers", &SimulateOptions::trainers));
  }
  const int dominant = dominant_assumption(rows, p.seconds);
  const int instances = o.receivers / o.instance_gpus;
  const uint64_t replica_bytes = p.total_bytes / uint64_t(instances);
  const double broadcast_s = broadcast_bound_seconds(replica_bytes, o.gpus_per_node, o.network);
  const NetworkModel& n = o.network;

  if (o.json) {
    json j;
    j["model"] = o.model;
    j["params"] = params;
    j["trainers"] = o.trainers;
    j["receivers"] = o.receivers;
    j["gpus_per_node"] = o.gpus_per_node;
    j["instance_gpus"] = o.instance_gpus;
    j["dense_mesh"] = o.dense_mesh;
    j["expert_mesh"] = o.expert_mesh;
    j["dtype"] = o.dtype;
    j["shard_dtype"] = o.shard_dtype;
    j["network"] = {{"nic_gbps", n.nic_gbps},
                    {"nvlink_gbps", n.nvlink_gbps},
                    {"message_overhead_us", n.message_overhead_us},
                    {"prepare_gbs", n.prepare_gbs},
                    {"barrier_ms", n.barrier_ms},
                    {"overlap", n.overlap}};
    j["predicted_s"] = p.seconds;
    j["bound"] = p.bound;
    j["tasks"] = p.tasks;
    j["messages"] = p.total_messages;
    j["gathers"] = p.gathers;
    j["bytes"] = p.total_bytes;
    j["gathered_bytes"] = p.gathered_bytes;
    j["replica_bytes"] = replica_bytes;
    j["critical_sender"] = p.critical_sender;
    j["critical_receiver"] = p.critical_receiver;
    j["sender_bytes"] = {{"max", p.sender_bytes_max}, {"mean", p.sender_bytes_mean}};
    j["receiver_bytes"] = {{"max", p.receiver_bytes_max}, {"mean", p.receiver_bytes_mean}};
    j["schedule_s"] = base.schedule_seconds;
    j["broadcast_bound_s"] = broadcast_s;
    json groups = json::array();
    for (const GroupPrediction& g : p.groups) {
      json terms = json::object();
      for (const Term& t : g.terms) terms[t.name] = {{"seconds", t.seconds}, {"rank", t.rank}};
      groups.push_back({{"name", g.name},
                        {"seconds", g.seconds},
                        {"bound", g.bound},
                        {"fill_s", g.fill_seconds},
                        {"terms", terms},
                        {"write_data_s", g.write_data_seconds},
                        {"write_overhead_s", g.write_overhead_seconds}});
    }
    j["groups"] = groups;
    json sens = json::array();
    for (const Sensitivity& s : rows) {
      sens.push_back({{"assumption", s.name},
                      {"base", s.base},
                      {"half", s.half},
                      {"twice", s.twice},
                      {"half_s", s.valid ? json(s.half_seconds) : json()},
                      {"twice_s", s.valid ? json(s.twice_seconds) : json()}});
    }
    j["sensitivity"] = sens;
    j["dominant"] = dominant >= 0 ? json(rows[size_t(dominant)].name) : json();
    return j.dump(1) + "\n";
  }

  std::ostringstream os;
  char line[256];
  os << "transfer simulate: " << o.model << " (" << with_commas(params) << " parameters), "
     << o.trainers << " trainer GPUs (" << o.shard_dtype << ") -> " << o.receivers
     << " inference GPUs (" << o.dtype << ")\n";
  os << "trainers: dense weights FSDP over meshes of " << o.dense_mesh << " ("
     << o.trainers / o.dense_mesh << " replicas); routed experts ";
  if (o.expert_mesh > 0) {
    os << "expert parallel over " << o.trainers / o.expert_mesh << " meshes of " << o.expert_mesh
       << "\n";
  } else {
    os << "sharded like the dense weights\n";
  }
  os << "receivers: " << instances << " instance(s) of " << o.instance_gpus << " GPUs ("
     << (o.model == "kimi-k2" ? "dense TP, experts EP" : "TP") << "), " << o.gpus_per_node
     << " GPUs per node; one replica is " << gb(double(replica_bytes)) << "\n";
  std::snprintf(line, sizeof line,
                "network: NIC %g Gb/s, NVLink %g Gb/s, %g us per put, prepare %g GB/s, "
                "barrier %g ms, overlap %s\n",
                n.nic_gbps, n.nvlink_gbps, n.message_overhead_us, n.prepare_gbs, n.barrier_ms,
                n.overlap ? "on" : "off");
  os << line;
  os << "schedule: " << p.tasks << " tasks, " << p.total_messages << " puts, " << p.gathers
     << " gathers, " << gb(double(p.total_bytes)) << " written (" << gb(double(p.gathered_bytes))
     << " after a gather); scheduled in " << secs(base.schedule_seconds) << "\n\n";

  os << "group    time        bound\n";
  for (const GroupPrediction& g : p.groups) {
    std::snprintf(line, sizeof line, "%-7s  %-10s  %s\n", g.name.c_str(), secs(g.seconds).c_str(),
                  g.bound.c_str());
    os << line;
    for (const Term& t : g.terms) {
      std::string who = t.rank < 0 ? ""
                                   : (t.name.rfind("receiver", 0) == 0 ? "receiver " : "trainer ") +
                                         std::to_string(t.rank);
      std::snprintf(line, sizeof line, "           %-26s %-10s %s\n", t.name.c_str(),
                    secs(t.seconds).c_str(), who.c_str());
      os << line;
    }
    std::snprintf(line, sizeof line,
                  "           (sender NIC out = %s of bytes + %s of put overhead; fill %s)\n",
                  secs(g.write_data_seconds).c_str(), secs(g.write_overhead_seconds).c_str(),
                  secs(g.fill_seconds).c_str());
    os << line;
  }
  os << "total    " << secs(p.seconds) << "  (" << p.bound << ")\n\n";
  os << "critical sender: trainer " << p.critical_sender << " (busy "
     << secs(p.critical_sender_seconds) << "); critical receiver: receiver " << p.critical_receiver
     << " (" << secs(p.critical_receiver_seconds) << " of bytes in)\n";
  os << "bytes per sender: max " << gb(double(p.sender_bytes_max)) << ", mean "
     << gb(p.sender_bytes_mean) << "; per receiver: max " << gb(double(p.receiver_bytes_max))
     << ", mean " << gb(p.receiver_bytes_mean) << "\n";
  os << "checkpoint-engine broadcast at best (every GPU receives the whole replica): "
     << secs(broadcast_s) << "\n";
  if (!rows.empty()) {
    os << "\nsensitivity: each assumption halved and doubled, the rest as above\n";
    os << "assumption              base        x0.5: value -> time       x2: value -> time\n";
    for (const Sensitivity& s : rows) {
      if (!s.valid) {
        std::snprintf(line, sizeof line, "%-22s  %-10g  (halved or doubled layout invalid)\n",
                      s.name.c_str(), s.base);
      } else {
        std::snprintf(line, sizeof line, "%-22s  %-10g  %-9g -> %-10s   %-9g -> %s\n",
                      s.name.c_str(), s.base, s.half, secs(s.half_seconds).c_str(), s.twice,
                      secs(s.twice_seconds).c_str());
      }
      os << line;
    }
    if (dominant >= 0) os << "dominant assumption: " << rows[size_t(dominant)].name << "\n";
  }
  return os.str();
}

}  // namespace wl::transfer
