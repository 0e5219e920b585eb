// The planner of plan/planner.h: validation, cutting tasks, choosing senders by bytes so far, and
// the plan's JSON.
#include "weightlift/transfer/plan/planner.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_map>

#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/sharded_tensor.h"

namespace wl::transfer {
namespace {

using nlohmann::json;

std::string rank_name(const char* role, int rank) {
  return std::string(role) + " rank " + std::to_string(rank);
}

std::string describe(DType d, const Shape& s) {
  return std::string(dtype_name(d)) + " " + shape_to_string(s);
}

// A task before its sender is chosen.
struct Unit {
  PlanTask task;
  int direct_mesh_rank = -1;  // -1: needs a gather
};

}  // namespace

const PlanTrainer* Plan::find_trainer(int rank) const {
  for (const PlanTrainer& t : trainers) {
    if (t.rank == rank) return &t;
  }
  return nullptr;
}

const PlanReceiver* Plan::find_receiver(int rank) const {
  for (const PlanReceiver& r : receivers) {
    if (r.rank == rank) return &r;
  }
  return nullptr;
}

Result<Plan> make_plan(std::span<const RankMeta> ranks) {
  Plan plan;
  std::vector<const RankMeta*> trainers, receivers;
  for (const RankMeta& m : ranks) (m.role == Role::kTrainer ? trainers : receivers).push_back(&m);
  if (trainers.empty()) return invalid_argument("transfer plan: no trainer rank");
  if (receivers.empty()) return invalid_argument("transfer plan: no receiver rank");

  // ---- trainers: one config, full meshes, shards where their mesh rank says ---------------
  const RankMeta& t0 = *trainers.front();
  WL_ASSIGN_OR_RETURN(model::ModelConfig config,
                      model::parse_config(t0.config_json, rank_name("trainer", t0.rank)));
  plan.config_json = model::config_to_json(config);
  plan.mesh_size = t0.mesh_size;
  if (plan.mesh_size < 1 || trainers.size() % size_t(plan.mesh_size) != 0) {
    return invalid_argument("transfer plan: " + std::to_string(trainers.size()) +
                            " trainers do not make whole meshes of " +
                            std::to_string(plan.mesh_size));
  }
  plan.num_meshes = int(trainers.size()) / plan.mesh_size;
  const model::ParamLayout layout(config);
  std::set<std::pair<int, int>> seats;
  for (const RankMeta* t : trainers) {
    const std::string who = rank_name("trainer", t->rank);
    WL_ASSIGN_OR_RETURN(model::ModelConfig c, model::parse_config(t->config_json, who));
    if (model::config_to_json(c) != plan.config_json) {
      return invalid_argument(who + ": its model config differs from trainer rank " +
                              std::to_string(t0.rank) + "'s");
    }
    if (t->mesh_size != plan.mesh_size || t->mesh_id < 0 || t->mesh_id >= plan.num_meshes ||
        t->mesh_rank < 0 || t->mesh_rank >= plan.mesh_size ||
        !seats.insert({t->mesh_id, t->mesh_rank}).second) {
      return invalid_argument(who + ": mesh " + std::to_string(t->mesh_id) + " rank " +
                              std::to_string(t->mesh_rank) + " of size " +
                              std::to_string(t->mesh_size) + " does not fit " +
                              std::to_string(plan.num_meshes) + " meshes of " +
                              std::to_string(plan.mesh_size));
    }
    std::unordered_map<std::string_view, const ParamMeta*> by_name;
    for (const ParamMeta& p : t->params) by_name.emplace(p.name, &p);
    for (const model::ParamInfo& info : layout.params()) {
      auto it = by_name.find(info.name);
      if (it == by_name.end()) {
        return not_found(who + ": holds no parameter '" + info.name + "' (the model has it)");
      }
      const ParamMeta& p = *it->second;
      if (p.shape != info.shape) {
        return invalid_argument(who + ": parameter '" + info.name + "' has shape " +
                                shape_to_string(p.shape) + ", the model config says " +
                                shape_to_string(info.shape));
      }
      if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
        return invalid_argument(who + ": parameter '" + info.name + "' is " +
                                std::string(dtype_name(p.dtype)) + "; shards are F32 or BF16");
      }
      const ShardRows want = shard_rows(info.shape[0], plan.mesh_size, t->mesh_rank);
      if (p.row_begin != want.begin || p.row_end != want.end) {
        return invalid_argument(who + ": parameter '" + info.name + "' holds rows [" +
                                std::to_string(p.row_begin) + ", " + std::to_string(p.row_end) +
                                "), mesh rank " + std::to_string(t->mesh_rank) + " of " +
                                std::to_string(plan.mesh_size) + " should hold [" +
                                std::to_string(want.begin) + ", " + std::to_string(want.end) + ")");
      }
    }
    plan.trainers.push_back({t->rank, t->mesh_id, t->mesh_rank});
  }

  // ---- receivers: exactly the inference layout of the trainers' model --------------------
  std::vector<std::vector<ReceiverTensor>> expected(receivers.size());
  std::vector<std::unordered_map<std::string_view, const TensorMeta*>> declared(receivers.size());
  for (size_t i = 0; i < receivers.size(); ++i) {
    const RankMeta& r = *receivers[i];
    const std::string who = rank_name("receiver", r.rank);
    auto lay = inference_layout(config, {.tp = r.tp, .tp_rank = r.tp_rank, .format = r.format});
    if (!lay.ok()) return invalid_argument(who + ": " + lay.status().message());
    expected[i] = std::move(*lay);
    if (r.rkey.empty() || r.worker_address.empty()) {
      return invalid_argument(who + ": no rkey or worker address in its metadata");
    }
    std::unordered_map<std::string_view, const ReceiverTensor*> want;
    for (const ReceiverTensor& t : expected[i]) want.emplace(t.name, &t);
    for (const TensorMeta& t : r.tensors) {
      if (!want.count(t.name)) {
        return not_found(who + ": tensor '" + t.name + "' is not in the inference layout at tp " +
                         std::to_string(r.tp) + " (" + std::string(weight_format_name(r.format)) +
                         "); no trainer parameter produces it");
      }
      if (!declared[i].emplace(t.name, &t).second) {
        return invalid_argument(who + ": tensor '" + t.name + "' declared twice");
      }
    }
    for (const ReceiverTensor& t : expected[i]) {
      auto it = declared[i].find(t.name);
      if (it == declared[i].end()) {
        return not_found(who + ": holds no tensor '" + t.name + "' (the inference layout has it)");
      }
      const TensorMeta& m = *it->second;
      if (m.dtype != t.dtype || m.shape != t.shape) {
        return invalid_argument(who + ": tensor '" + t.name + "' is " + describe(m.dtype, m.shape) +
                                ", the inference layout at tp " + std::to_string(r.tp) + " needs " +
                                describe(t.dtype, t.shape));
      }
      if (m.bytes != t.nbytes() || m.offset + m.bytes > r.slot_bytes) {
        return invalid_argument(who + ": tensor '" + t.name + "' at bytes [" +
                                std::to_string(m.offset) + ", +" + std::to_string(m.bytes) +
                                ") does not fit its " + std::to_string(r.slot_bytes) + "-byte slot");
      }
    }
    plan.receivers.push_back({r.rank, r.engine, r.tp, r.tp_rank, r.format, r.epoch,
                              r.worker_address, {r.slot_address[0], r.slot_address[1]},
                              r.slot_bytes, r.rkey});
  }

  // ---- cut tasks, family by family, dense first ------------------------------------------
  std::vector<std::pair<bool, std::string>> families;
  std::set<std::string> seen;
  for (const auto& lay : expected) {
    for (const ReceiverTensor& t : lay) {
      if (t.sources.empty() || !seen.insert(t.name).second) continue;  // scales ride along
      families.push_back({t.expert, t.name});
    }
  }
  std::stable_sort(families.begin(), families.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });

  std::map<int, uint64_t> load;  // bytes assigned so far, by trainer world rank
  for (const PlanTrainer& t : plan.trainers) load[t.rank] = 0;
  auto pick = [&](auto&& eligible) {
    int best = -1;
    for (const PlanTrainer& t : plan.trainers) {
      if (eligible(t) && (best < 0 || load[t.rank] < load[best])) best = t.rank;
    }
    WL_CHECK_GE(best, 0);
    return best;
  };
  auto param_rows = [&](const std::string& name) { return layout.at(name).shape[0]; };

  for (const auto& [expert, name] : families) {
    std::vector<Unit> units;
    for (size_t i = 0; i < receivers.size(); ++i) {
      const ReceiverTensor* t = nullptr;
      for (const ReceiverTensor& x : expected[i]) {
        if (x.name == name) t = &x;
      }
      if (t == nullptr) continue;
      const TensorMeta& m = *declared[i].at(t->name);
      const size_t es = dtype_size(t->dtype);
      auto base = [&](int64_t r0, int64_t r1) {
        PlanTask k{.receiver = receivers[i]->rank, .tensor = t->name, .expert = t->expert,
                   .row_begin = r0, .row_end = r1, .cols = t->cols, .dtype = t->dtype};
        k.dst_offset = m.offset + uint64_t(r0 * t->cols) * es;
        k.bytes = uint64_t((r1 - r0) * t->cols) * es;
        return k;
      };
      if (!t->quantized()) {
        for (const SourceSlice& s : t->sources) {
          for (int k = 0; k < plan.mesh_size; ++k) {
            const ShardRows sh = shard_rows(param_rows(s.param), plan.mesh_size, k);
            const int64_t b = std::max(s.row_begin, sh.begin), e = std::min(s.row_end, sh.end);
            if (b >= e) continue;
            const int64_t d0 = s.dst_row + b - s.row_begin;
            Unit u{base(d0, d0 + e - b), k};
            u.task.pieces.push_back({s.param, b, e, s.col_begin, s.col_end, d0});
            units.push_back(std::move(u));
          }
        }
        continue;
      }
      const TensorMeta& sm = *declared[i].at(t->scale);
      const int64_t scale_cols = (t->cols + kFp8BlockSize - 1) / kFp8BlockSize;
      for (int64_t r0 = 0; r0 < t->rows; r0 += kFp8BlockSize) {
        const int64_t r1 = std::min(t->rows, r0 + kFp8BlockSize);
        Unit u{base(r0, r1), -1};
        u.task.scale_offset = sm.offset + uint64_t(r0 / kFp8BlockSize * scale_cols) * 4;
        u.task.scale_bytes = uint64_t(scale_cols) * 4;
        for (const SourceSlice& s : t->sources) {
          const int64_t b = std::max(s.dst_row, r0), e = std::min(s.dst_row + s.rows(), r1);
          if (b >= e) continue;
          u.task.pieces.push_back({s.param, s.row_begin + b - s.dst_row,
                                   s.row_begin + e - s.dst_row, s.col_begin, s.col_end, b});
        }
        for (int k = 0; k < plan.mesh_size && u.direct_mesh_rank < 0; ++k) {
          bool all = true;
          for (const PlanPiece& p : u.task.pieces) {
            all = all && shard_rows(param_rows(p.param), plan.mesh_size, k)
                             .contains(p.row_begin, p.row_end);
          }
          if (all) u.direct_mesh_rank = k;
        }
        units.push_back(std::move(u));
      }
    }

    // The family's gather, if any band needs one: on the least-loaded mesh.
    int gather = -1, gather_mesh = -1;
    PlanGather g{.expert = expert, .before_task = int(plan.tasks.size())};
    for (const Unit& u : units) {
      if (u.direct_mesh_rank >= 0) continue;
      for (const PlanPiece& p : u.task.pieces) {
        if (std::find(g.params.begin(), g.params.end(), p.param) == g.params.end()) {
          g.params.push_back(p.param);
        }
      }
    }
    if (!g.params.empty()) {
      std::vector<uint64_t> mesh_load(size_t(plan.num_meshes), 0);
      for (const PlanTrainer& t : plan.trainers) mesh_load[size_t(t.mesh_id)] += load[t.rank];
      gather_mesh = int(std::min_element(mesh_load.begin(), mesh_load.end()) - mesh_load.begin());
      g.mesh = gather_mesh;
      gather = int(plan.gathers.size());
      plan.gathers.push_back(std::move(g));
    }
    for (Unit& u : units) {
      if (u.direct_mesh_rank >= 0) {
        u.task.sender = pick([&](const PlanTrainer& t) { return t.mesh_rank == u.direct_mesh_rank; });
      } else {
        u.task.gather = gather;
        u.task.sender = pick([&](const PlanTrainer& t) { return t.mesh_id == gather_mesh; });
      }
      load[u.task.sender] += u.task.total_bytes();
      plan.tasks.push_back(std::move(u.task));
    }
  }
  return plan;
}

// ---- JSON ---------------------------------------------------------------------------------

std::string plan_to_json(const Plan& p) {
  json j;
  j["format"] = "weightlift-transfer-plan";
  j["version"] = Plan::kFormatVersion;
  j["config"] = json::parse(p.config_json);
  j["mesh_size"] = p.mesh_size;
  j["num_meshes"] = p.num_meshes;
  json ts = json::array();
  for (const PlanTrainer& t : p.trainers) {
    ts.push_back({{"rank", t.rank}, {"mesh", t.mesh_id}, {"mesh_rank", t.mesh_rank}});
  }
  j["trainers"] = ts;
  json rs = json::array();
  for (const PlanReceiver& r : p.receivers) {
    rs.push_back({{"rank", r.rank}, {"engine", r.engine}, {"tp", r.tp}, {"tp_rank", r.tp_rank},
                  {"format", weight_format_name(r.format)}, {"epoch", std::to_string(r.epoch)},
                  {"worker_address", to_hex(r.worker_address)},
                  {"slot_address", {std::to_string(r.slot_address[0]),
                                    std::to_string(r.slot_address[1])}},
                  {"slot_bytes", std::to_string(r.slot_bytes)}, {"rkey", to_hex(r.rkey)}});
  }
  j["receivers"] = rs;
  json gs = json::array();
  for (const PlanGather& g : p.gathers) {
    gs.push_back({{"mesh", g.mesh}, {"expert", g.expert}, {"before_task", g.before_task},
                  {"params", g.params}});
  }
  j["gathers"] = gs;
  json ks = json::array();
  for (const PlanTask& k : p.tasks) {
    json pieces = json::array();
    for (const PlanPiece& q : k.pieces) {
      pieces.push_back({{"param", q.param}, {"rows", {q.row_begin, q.row_end}},
                        {"cols", {q.col_begin, q.col_end}}, {"dst_row", q.dst_row}});
    }
    ks.push_back({{"sender", k.sender}, {"receiver", k.receiver}, {"tensor", k.tensor},
                  {"expert", k.expert}, {"gather", k.gather}, {"rows", {k.row_begin, k.row_end}},
                  {"cols", k.cols}, {"dtype", dtype_name(k.dtype)},
                  {"dst_offset", k.dst_offset}, {"bytes", k.bytes},
                  {"scale_offset", k.scale_offset}, {"scale_bytes", k.scale_bytes},
                  {"pieces", pieces}});
  }
  j["tasks"] = ks;
  return j.dump(1);
}

Result<Plan> plan_from_json(std::string_view text, std::string_view where) {
  const std::string w(where);
  try {
    const json j = json::parse(text);
    if (j.at("format") != "weightlift-transfer-plan") {
      return data_loss(w + ": not a weightlift transfer plan (format '" +
                       j.at("format").dump() + "')");
    }
    const int version = j.at("version").get<int>();
    if (version != Plan::kFormatVersion) {
      return failed_precondition(w + ": transfer plan version " + std::to_string(version) +
                                 ", this build reads version " +
                                 std::to_string(Plan::kFormatVersion) +
                                 "; plan again with this build");
    }
    Plan p;
    p.config_json = j.at("config").dump();
    WL_ASSIGN_OR_RETURN(model::ModelConfig c, model::parse_config(p.config_json, w));
    p.config_json = model::config_to_json(c);
    p.mesh_size = j.at("mesh_size").get<int>();
    p.num_meshes = j.at("num_meshes").get<int>();
    for (const json& t : j.at("trainers")) {
      p.trainers.push_back({t.at("rank").get<int>(), t.at("mesh").get<int>(),
                            t.at("mesh_rank").get<int>()});
    }
    auto u64 = [](const json& x) { return uint64_t(std::stoull(x.get<std::string>())); };
    auto hex = [&](const json& x) {
      auto b = from_hex(x.get<std::string>());
      if (!b) throw std::runtime_error("bad hex string");
      return *b;
    };
    for (const json& r : j.at("receivers")) {
      auto f = weight_format_from_name(r.at("format").get<std::string>());
      if (!f) throw std::runtime_error("unknown format");
      p.receivers.push_back({r.at("rank").get<int>(), r.at("engine").get<int>(),
                             r.at("tp").get<int>(), r.at("tp_rank").get<int>(), *f,
                             u64(r.at("epoch")), hex(r.at("worker_address")),
                             {u64(r.at("slot_address").at(0)), u64(r.at("slot_address").at(1))},
                             u64(r.at("slot_bytes")), hex(r.at("rkey"))});
    }
    for (const json& g : j.at("gathers")) {
      p.gathers.push_back({g.at("mesh").get<int>(), g.at("expert").get<bool>(),
                           g.at("before_task").get<int>(),
                           g.at("params").get<std::vector<std::string>>()});
    }
    for (const json& k : j.at("tasks")) {
      PlanTask t;
      t.sender = k.at("sender").get<int>();
      t.receiver = k.at("receiver").get<int>();
      t.tensor = k.at("tensor").get<std::string>();
      t.expert = k.at("expert").get<bool>();
      t.gather = k.at("gather").get<int>();
      t.row_begin = k.at("rows").at(0).get<int64_t>();
      t.row_end = k.at("rows").at(1).get<int64_t>();
      t.cols = k.at("cols").get<int64_t>();
      auto d = dtype_from_name(k.at("dtype").get<std::string>());
      if (!d) throw std::runtime_error("unknown dtype");
      t.dtype = *d;
      t.dst_offset = k.at("dst_offset").get<uint64_t>();
      t.bytes = k.at("bytes").get<uint64_t>();
      t.scale_offset = k.at("scale_offset").get<uint64_t>();
      t.scale_bytes = k.at("scale_bytes").get<uint64_t>();
      for (const json& q : k.at("pieces")) {
        t.pieces.push_back({q.at("param").get<std::string>(), q.at("rows").at(0).get<int64_t>(),
                            q.at("rows").at(1).get<int64_t>(), q.at("cols").at(0).get<int64_t>(),
                            q.at("cols").at(1).get<int64_t>(), q.at("dst_row").get<int64_t>()});
      }
      if (t.gather < -1 || t.gather >= int(p.gathers.size()) ||
          p.find_trainer(t.sender) == nullptr || p.find_receiver(t.receiver) == nullptr) {
        throw std::runtime_error("task " + std::to_string(p.tasks.size()) +
                                 " names an unknown gather, sender or receiver");
      }
      p.tasks.push_back(std::move(t));
    }
    return p;
  } catch (const std::exception& e) {
    return data_loss(w + ": malformed transfer plan: " + e.what());
  }
}

std::vector<uint64_t> plan_bytes_by_rank(const Plan& p) {
  int n = 0;
  for (const PlanTrainer& t : p.trainers) n = std::max(n, t.rank + 1);
  for (const PlanReceiver& r : p.receivers) n = std::max(n, r.rank + 1);
  std::vector<uint64_t> bytes(size_t(n), 0);
  for (const PlanTask& k : p.tasks) {
    bytes[size_t(k.sender)] += k.total_bytes();
    bytes[size_t(k.receiver)] += k.total_bytes();
  }
  return bytes;
}

}  // namespace wl::transfer
