// `weightlift transfer simulate`'s report: a simulated cluster update (transfer/sim/cluster.h)
// as a table with the per-group terms and the sensitivity rows, or as one JSON object.
#include "report/transfer_simulate.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "report/units.h"

namespace wl::app {
namespace {

using nlohmann::json;
using transfer::GroupPrediction;
using transfer::Prediction;
using transfer::Sensitivity;
using transfer::Term;

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", bytes / 1e9);
  return b;
}

// A sensitivity row's assumption, named by its field (nic_gbps), as the option a user of this
// command sets: --nic-gbps.
std::string as_flag(const std::string& field) {
  std::string flag = "--" + field;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
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

}  // namespace

std::string simulation_json(const transfer::ClusterOptions& o, const transfer::Simulation& s) {
  const Prediction& p = s.prediction;
  const transfer::NetworkModel& n = o.network;
  json j;
  j["model"] = o.model;
  j["params"] = s.params;
  j["trainers"] = o.trainers;
  j["receivers"] = o.receivers;
  j["gpus_per_node"] = o.gpus_per_node;
  j["engine_gpus"] = o.engine_gpus;
  j["dense_mesh"] = o.dense_mesh;
  j["expert_mesh"] = o.expert_mesh;
  j["dtype"] = transfer::weight_format_name(o.format);
  j["shard_dtype"] = o.shard_dtype == DType::kF32 ? "f32" : "bf16";
  j["network"] = {{"nic_gbps", n.nic_gbps},       {"gpus_per_nic", n.gpus_per_nic},
                  {"nvlink_gbps", n.nvlink_gbps}, {"message_overhead_us", n.message_overhead_us},
                  {"prepare_gbs", n.prepare_gbs}, {"barrier_ms", n.barrier_ms},
                  {"maxima_ms", n.maxima_ms},     {"overlap", n.overlap}};
  j["predicted_s"] = p.seconds;
  j["bound"] = p.bound;
  j["tasks"] = p.tasks;
  j["messages"] = p.total_messages;
  j["split_bands"] = p.split_bands;
  j["bytes"] = p.total_bytes;
  j["split_bytes"] = p.split_bytes;
  j["replica_bytes"] = s.replica_bytes;
  j["critical_sender"] = p.critical_sender;
  j["critical_receiver"] = p.critical_receiver;
  j["sender_bytes"] = {{"max", p.sender_bytes_max}, {"mean", p.sender_bytes_mean}};
  j["receiver_bytes"] = {{"max", p.receiver_bytes_max}, {"mean", p.receiver_bytes_mean}};
  j["schedule_s"] = s.schedule_seconds;
  j["broadcast_bound_s"] = s.broadcast_bound_s;
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
  for (const Sensitivity& r : s.sensitivity) {
    sens.push_back({{"assumption", as_flag(r.name)},
                    {"base", r.base},
                    {"half", r.half},
                    {"twice", r.twice},
                    {"half_s", r.valid ? json(r.half_seconds) : json()},
                    {"twice_s", r.valid ? json(r.twice_seconds) : json()}});
  }
  j["sensitivity"] = sens;
  j["dominant"] = s.dominant >= 0 ? json(as_flag(s.sensitivity[size_t(s.dominant)].name)) : json();
  return j.dump(1) + "\n";
}

std::string simulation_report(const transfer::ClusterOptions& o, const transfer::Simulation& s) {
  const Prediction& p = s.prediction;
  const transfer::NetworkModel& n = o.network;
  std::ostringstream os;
  char line[256];
  os << "transfer simulate: " << o.model << " (" << with_commas(s.params) << " parameters), "
     << o.trainers << " trainer GPUs (" << (o.shard_dtype == DType::kF32 ? "f32" : "bf16")
     << ") -> " << o.receivers << " inference GPUs (" << transfer::weight_format_name(o.format)
     << ")\n";
  os << "trainers: dense weights FSDP over meshes of " << o.dense_mesh << " ("
     << o.trainers / o.dense_mesh << " replicas); routed experts ";
  if (o.expert_mesh > 0) {
    os << "expert parallel over " << o.trainers / o.expert_mesh << " meshes of " << o.expert_mesh
       << "\n";
  } else {
    os << "sharded like the dense weights\n";
  }
  os << "receivers: " << o.receivers / o.engine_gpus << " engine(s) of " << o.engine_gpus
     << " GPUs (" << (o.model == "kimi-k2" ? "dense TP, experts EP" : "TP") << "), "
     << o.gpus_per_node << " GPUs per node; one replica is " << gb(double(s.replica_bytes)) << "\n";
  std::snprintf(line, sizeof line,
                "network: NIC %g Gb/s (one per %d GPUs), NVLink %g Gb/s, %g us per put, "
                "prepare %g GB/s, barrier %g ms, %g ms per shared-maxima round, overlap %s\n",
                n.nic_gbps, n.gpus_per_nic, n.nvlink_gbps, n.message_overhead_us, n.prepare_gbs,
                n.barrier_ms, n.maxima_ms, n.overlap ? "on" : "off");
  os << line;
  os << "schedule: " << p.tasks << " tasks, " << p.total_messages << " puts, " << p.split_bands
     << " bands split across mesh ranks, " << gb(double(p.total_bytes)) << " written ("
     << gb(double(p.split_bytes)) << " in their sub-bands); scheduled in "
     << secs(s.schedule_seconds) << "\n\n";

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
     << secs(s.broadcast_bound_s) << "\n";
  if (!s.sensitivity.empty()) {
    os << "\nsensitivity: each assumption halved and doubled, the rest as above\n";
    os << "assumption              base        x0.5: value -> time       x2: value -> time\n";
    for (const Sensitivity& r : s.sensitivity) {
      if (!r.valid) {
        std::snprintf(line, sizeof line, "%-22s  %-10g  (halved or doubled layout invalid)\n",
                      as_flag(r.name).c_str(), r.base);
      } else {
        std::snprintf(line, sizeof line, "%-22s  %-10g  %-9g -> %-10s   %-9g -> %s\n",
                      as_flag(r.name).c_str(), r.base, r.half, secs(r.half_seconds).c_str(),
                      r.twice, secs(r.twice_seconds).c_str());
      }
      os << line;
    }
    if (s.dominant >= 0) {
      os << "dominant assumption: " << as_flag(s.sensitivity[size_t(s.dominant)].name) << "\n";
    }
  }
  return os.str();
}

}  // namespace wl::app
