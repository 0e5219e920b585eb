// The planner of plan/planner.h: validation, cutting tasks, choosing senders by bytes so far, and
// the plan's JSON.
#include "weightlift/transfer/plan/planner.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "weightlift/model/params.h"
#include "weightlift/transfer/layout/layout_spec.h"
#include "weightlift/transfer/plan/cutting.h"

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
  int mesh_rank = 0;  // which rank of a mesh holds every row it reads
  int band = -1;      // a sub-band: its split band's number, the same for all its sub-bands
};

// What direct_mesh_rank and split_band (cutting.h) ask of a piece.
struct PieceRows {
  const RowSplit* split = nullptr;  // the piece's parameter's
  int64_t b = 0, e = 0, dst = 0;
};

// One receiver's metadata beside the layout it must hold.
struct ReceiverSide {
  const RankMeta* meta = nullptr;
  std::vector<ReceiverTensor> expected;  // the inference layout at its TP rank and format
  std::unordered_map<std::string_view, const TensorMeta*> declared;  // what it says it holds
};

// make_plan's state: the checked ranks, then the tasks family by family.
class Planner {
 public:
  explicit Planner(std::span<const RankMeta> ranks);
  Result<Plan> run();

 private:
  Status check_config();
  Status check_trainer(const RankMeta& t, std::set<std::pair<int, int>>& seats);
  Status check_params(const RankMeta& t);
  // Every parameter's split over the meshes' ranks, the same in every mesh (splits_).
  Status check_splits();
  Status check_receiver(ReceiverSide& side);
  Status check_declared(const ReceiverSide& side);
  std::vector<std::pair<bool, std::string>> families() const;
  std::vector<Unit> cut(const std::string& family);
  void cut_bf16(const ReceiverSide& side, const ReceiverTensor& t, std::vector<Unit>& units);
  void cut_fp8(const ReceiverSide& side, const ReceiverTensor& t, std::vector<Unit>& units);
  PlanTask task_rows(const ReceiverSide& side, const ReceiverTensor& t, int64_t r0,
                     int64_t r1) const;
  void assign(std::vector<Unit>& units);
  int least_loaded_mesh();
  const RowSplit& split(const std::string& param) const { return splits_.at(param); }

  std::vector<const RankMeta*> trainers_;
  std::vector<ReceiverSide> receivers_;
  // What the trainers hold: our model (config_), whose receivers hold its inference layout,
  // or another (spec_), whose receivers hold what its layout spec says.
  std::optional<model::ModelConfig> config_;
  std::optional<LayoutSpec> spec_;
  std::string layout_json_;              // spec_'s canonical JSON, which every trainer matches
  std::map<std::string, Shape> params_;  // every trainer parameter's full shape
  // The rows each trainer holds, per parameter, mesh and mesh rank; then each parameter's
  // split over a mesh.
  std::map<std::string, std::vector<std::vector<ShardRows>>> held_;
  std::map<std::string, RowSplit> splits_;
  std::map<std::pair<int, int>, int> seats_;  // trainer world rank by (mesh, mesh rank)
  std::map<int, uint64_t> load_;              // bytes assigned so far, by trainer world rank
  int split_bands_ = 0;                       // bands split so far
  std::vector<BandCut> cuts_;                 // split_band's scratch
  Plan plan_;
};

Planner::Planner(std::span<const RankMeta> ranks) {
  for (const RankMeta& m : ranks) {
    if (m.role == Role::kTrainer) {
      trainers_.push_back(&m);
    } else {
      receivers_.push_back({.meta = &m});
    }
  }
}

// Trainers: one model (our config, or one layout spec), whole meshes.
Status Planner::check_config() {
  if (trainers_.empty()) return invalid_argument("transfer plan: no trainer rank");
  if (receivers_.empty()) return invalid_argument("transfer plan: no receiver rank");
  const RankMeta& t0 = *trainers_.front();
  const std::string who = rank_name("trainer", t0.rank);
  if (!t0.config_json.empty()) {
    WL_ASSIGN_OR_RETURN(config_, model::parse_config(t0.config_json, who));
    plan_.config_json = model::config_to_json(*config_);
    const model::ParamLayout layout(*config_);
    for (const model::ParamInfo& p : layout.params()) params_[p.name] = p.shape;
  } else {
    WL_ASSIGN_OR_RETURN(spec_, layout_spec_from_json(t0.layout_json, who));
    WL_RETURN_IF_ERROR(check_layout_spec(*spec_).with_context(who));
    layout_json_ = layout_spec_to_json(*spec_);
    plan_.layout_name = spec_->name;
    params_ = spec_->params;
  }
  plan_.mesh_size = t0.mesh_size;
  if (plan_.mesh_size < 1 || trainers_.size() % size_t(plan_.mesh_size) != 0) {
    return invalid_argument("transfer plan: " + std::to_string(trainers_.size()) +
                            " trainers do not make whole meshes of " +
                            std::to_string(plan_.mesh_size));
  }
  plan_.num_meshes = int(trainers_.size()) / plan_.mesh_size;
  return ok_status();
}

// A trainer: the same config, a free seat in the meshes, every parameter where its seat says.
Status Planner::check_trainer(const RankMeta& t, std::set<std::pair<int, int>>& seats) {
  const std::string who = rank_name("trainer", t.rank);
  const std::string first = std::to_string(trainers_.front()->rank);
  if (t.config_json.empty() != plan_.config_json.empty()) {
    return invalid_argument(who + ": holds " +
                            (t.config_json.empty() ? "a layout spec's" : "our model's") +
                            " weights, trainer rank " + first + " the other kind");
  }
  if (!t.config_json.empty()) {
    WL_ASSIGN_OR_RETURN(model::ModelConfig c, model::parse_config(t.config_json, who));
    if (model::config_to_json(c) != plan_.config_json) {
      return invalid_argument(who + ": its model config differs from trainer rank " + first + "'s");
    }
  } else {
    WL_ASSIGN_OR_RETURN(LayoutSpec spec, layout_spec_from_json(t.layout_json, who));
    if (layout_spec_to_json(spec) != layout_json_) {
      return invalid_argument(who + ": its layout spec differs from trainer rank " + first + "'s");
    }
  }
  if (t.mesh_size != plan_.mesh_size || t.mesh_id < 0 || t.mesh_id >= plan_.num_meshes ||
      t.mesh_rank < 0 || t.mesh_rank >= plan_.mesh_size ||
      !seats.insert({t.mesh_id, t.mesh_rank}).second) {
    return invalid_argument(
        who + ": mesh " + std::to_string(t.mesh_id) + " rank " + std::to_string(t.mesh_rank) +
        " of size " + std::to_string(t.mesh_size) + " does not fit " +
        std::to_string(plan_.num_meshes) + " meshes of " + std::to_string(plan_.mesh_size));
  }
  WL_RETURN_IF_ERROR(check_params(t));
  plan_.trainers.push_back({t.rank, t.mesh_id, t.mesh_rank});
  seats_[{t.mesh_id, t.mesh_rank}] = t.rank;
  return ok_status();
}

Status Planner::check_params(const RankMeta& t) {
  const std::string who = rank_name("trainer", t.rank);
  std::unordered_map<std::string_view, const ParamMeta*> by_name;
  for (const ParamMeta& p : t.params) by_name.emplace(p.name, &p);
  for (const auto& [name, shape] : params_) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return not_found(who + ": holds no parameter '" + name + "' (the model has it)");
    }
    const ParamMeta& p = *it->second;
    if (p.shape != shape) {
      return invalid_argument(who + ": parameter '" + name + "' has shape " +
                              shape_to_string(p.shape) + ", the model says " +
                              shape_to_string(shape));
    }
    if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
      return invalid_argument(who + ": parameter '" + name + "' is " +
                              std::string(dtype_name(p.dtype)) + "; shards are F32 or BF16");
    }
    if (p.row_begin < 0 || p.row_end < p.row_begin || p.row_end > shape[0]) {
      return invalid_argument(who + ": parameter '" + name + "' holds rows [" +
                              std::to_string(p.row_begin) + ", " + std::to_string(p.row_end) +
                              ") of its " + std::to_string(shape[0]));
    }
    auto& meshes = held_[name];
    meshes.resize(size_t(plan_.num_meshes), std::vector<ShardRows>(size_t(plan_.mesh_size)));
    meshes[size_t(t.mesh_id)][size_t(t.mesh_rank)] = {p.row_begin, p.row_end};
  }
  return ok_status();
}

// Each parameter's rows over mesh 0's ranks, in mesh-rank order, must follow one another from
// the first row to the last; every other mesh must hold them alike (a replica).
Status Planner::check_splits() {
  auto rows_text = [](const ShardRows& r) {
    return "rows [" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
  };
  for (const auto& [name, meshes] : held_) {
    const std::vector<ShardRows>& first = meshes[0];
    for (size_t k = 0; k < first.size(); ++k) {
      const int64_t from = k == 0 ? 0 : first[k - 1].end;
      if (first[k].begin != from) {
        return invalid_argument(rank_name("trainer", seats_.at({0, int(k)})) + ": parameter '" +
                                name + "' holds " + rows_text(first[k]) + ", but " +
                                (k == 0 ? "the first mesh rank's rows start at row 0"
                                        : rank_name("trainer", seats_.at({0, int(k) - 1})) +
                                              " before it holds " + rows_text(first[k - 1])) +
                                " (each mesh rank's rows follow the previous rank's)");
      }
    }
    const int64_t rows = params_.at(name)[0];
    if (first.back().end != rows) {
      return invalid_argument(rank_name("trainer", seats_.at({0, int(first.size()) - 1})) +
                              ", the last of mesh 0: parameter '" + name + "' holds " +
                              rows_text(first.back()) + " of its " + std::to_string(rows) +
                              " rows (the mesh's ranks hold every row)");
    }
    WL_ASSIGN_OR_RETURN(RowSplit split, RowSplit::of(first, rows, "parameter '" + name + "'"));
    for (size_t m = 1; m < meshes.size(); ++m) {
      for (int k = 0; k < plan_.mesh_size; ++k) {
        if (meshes[m][size_t(k)] != split.rank_rows(k)) {
          return invalid_argument(rank_name("trainer", seats_.at({int(m), k})) + ": parameter '" +
                                  name + "' holds " + rows_text(meshes[m][size_t(k)]) + ", " +
                                  rank_name("trainer", seats_.at({0, k})) +
                                  " at its seat in mesh 0 holds " + rows_text(split.rank_rows(k)) +
                                  " (every mesh holds the same rows)");
        }
      }
    }
    splits_.emplace(name, std::move(split));
  }
  return ok_status();
}

// A receiver: exactly the inference layout of the trainers' model, at its TP rank and format.
Status Planner::check_receiver(ReceiverSide& side) {
  const RankMeta& r = *side.meta;
  const std::string who = rank_name("receiver", r.rank);
  const LayoutOptions layout{
      .tp = r.tp, .tp_rank = r.tp_rank, .ep = r.ep, .ep_rank = r.ep_rank, .format = r.format};
  if (!config_ && r.ep > 1) {
    return invalid_argument(who + ": ep " + std::to_string(r.ep) +
                            ": expert-parallel receivers need our model's config; a layout "
                            "spec's model has no EP layout");
  }
  auto lay = config_ ? inference_layout(*config_, layout)
                     : spec_layout(spec_in_format(*spec_, r.format), r.tp, r.tp_rank);
  if (!lay.ok()) return invalid_argument(who + ": " + lay.status().message());
  side.expected = std::move(*lay);
  if (r.rkey.empty() || r.worker_address.empty()) {
    return invalid_argument(who + ": no rkey or worker address in its metadata");
  }
  std::unordered_map<std::string_view, const ReceiverTensor*> want;
  for (const ReceiverTensor& t : side.expected) want.emplace(t.name, &t);
  for (const TensorMeta& t : r.tensors) {
    if (!want.count(t.name)) {
      return not_found(who + ": tensor '" + t.name + "' is not in the inference layout of " +
                       describe_rank(layout) + " (" + std::string(weight_format_name(r.format)) +
                       "); no trainer parameter produces it");
    }
    if (!side.declared.emplace(t.name, &t).second) {
      return invalid_argument(who + ": tensor '" + t.name + "' declared twice");
    }
  }
  WL_RETURN_IF_ERROR(check_declared(side));
  plan_.receivers.push_back({r.rank,
                             r.engine,
                             r.tp,
                             r.tp_rank,
                             r.ep,
                             r.ep_rank,
                             r.format,
                             r.epoch,
                             r.worker_address,
                             {r.slot_address[0], r.slot_address[1]},
                             r.slot_bytes,
                             r.rkey});
  return ok_status();
}

// Every tensor of the layout declared, of its dtype and shape, inside the slot.
Status Planner::check_declared(const ReceiverSide& side) {
  const RankMeta& r = *side.meta;
  const std::string who = rank_name("receiver", r.rank);
  for (const ReceiverTensor& t : side.expected) {
    auto it = side.declared.find(t.name);
    if (it == side.declared.end()) {
      return not_found(who + ": holds no tensor '" + t.name + "' (the inference layout has it)");
    }
    const TensorMeta& m = *it->second;
    if (m.dtype != t.dtype || m.shape != t.shape) {
      return invalid_argument(
          who + ": tensor '" + t.name + "' is " + describe(m.dtype, m.shape) +
          ", the inference layout of " +
          describe_rank({.tp = r.tp, .tp_rank = r.tp_rank, .ep = r.ep, .ep_rank = r.ep_rank}) +
          " needs " + describe(t.dtype, t.shape));
    }
    if (m.bytes != t.nbytes() || m.offset + m.bytes > r.slot_bytes) {
      return invalid_argument(who + ": tensor '" + t.name + "' at bytes [" +
                              std::to_string(m.offset) + ", +" + std::to_string(m.bytes) +
                              ") does not fit its " + std::to_string(r.slot_bytes) + "-byte slot");
    }
  }
  return ok_status();
}

// Receiver tensor names in order of first appearance, dense before expert (cutting.h); scale
// tensors ride along with their tensor.
std::vector<std::pair<bool, std::string>> Planner::families() const {
  std::vector<std::pair<bool, std::string>> out;
  std::set<std::string> seen;
  for (const ReceiverSide& side : receivers_) {
    for (const ReceiverTensor& t : side.expected) {
      if (t.sources.empty() || !seen.insert(t.name).second) continue;
      out.push_back({t.expert, t.name});
    }
  }
  dense_before_expert(out, [](const auto& f) { return f.first; });
  return out;
}

// A task for receiver rows [r0, r1) of `t`, before its pieces and sender.
PlanTask Planner::task_rows(const ReceiverSide& side, const ReceiverTensor& t, int64_t r0,
                            int64_t r1) const {
  const TensorMeta& m = *side.declared.at(t.name);
  const size_t es = dtype_size(t.dtype);
  PlanTask k{.receiver = side.meta->rank,
             .tensor = t.name,
             .expert = t.expert,
             .row_begin = r0,
             .row_end = r1,
             .cols = t.cols,
             .dtype = t.dtype};
  k.dst_offset = m.offset + uint64_t(r0 * t.cols) * es;
  k.bytes = uint64_t((r1 - r0) * t.cols) * es;
  return k;
}

void Planner::cut_bf16(const ReceiverSide& side, const ReceiverTensor& t,
                       std::vector<Unit>& units) {
  for (const SourceSlice& s : t.sources) {
    const RowSplit& sp = split(s.param);
    cut_at_shards(
        plan_.mesh_size, [&](int k) { return sp.rank_rows(k); }, s.row_begin, s.row_end, s.dst_row,
        [&](int k, int64_t b, int64_t e, int64_t d0) {
          Unit u{task_rows(side, t, d0, d0 + e - b), k};
          u.task.pieces.push_back({s.param, b, e, s.col_begin, s.col_end, d0});
          units.push_back(std::move(u));
        });
  }
}

void Planner::cut_fp8(const ReceiverSide& side, const ReceiverTensor& t, std::vector<Unit>& units) {
  const TensorMeta& sm = *side.declared.at(t.scale);
  const int64_t scale_cols = fp8_block_count(t.cols);
  for_each_band(t.rows, [&](int64_t r0, int64_t r1) {
    const uint64_t scale_offset = sm.offset + uint64_t(r0 / kFp8BlockSize * scale_cols) * 4;
    std::vector<PlanPiece> pieces;
    std::vector<PieceRows> rows;
    for (const SourceSlice& s : t.sources) {
      int64_t b = 0, e = 0, dst = 0;
      if (!band_piece(s.row_begin, s.rows(), s.dst_row, r0, r1, &b, &e, &dst)) continue;
      pieces.push_back({s.param, b, e, s.col_begin, s.col_end, dst});
      rows.push_back({&split(s.param), b, e, dst});
    }
    auto shard_of = [](const PieceRows& p, int k) { return p.split->rank_rows(k); };
    const int direct = direct_mesh_rank(plan_.mesh_size, rows, shard_of);
    if (direct >= 0) {
      Unit u{task_rows(side, t, r0, r1), direct};
      u.task.scale_offset = scale_offset;
      u.task.scale_bytes = uint64_t(scale_cols) * 4;
      u.task.pieces = std::move(pieces);
      units.push_back(std::move(u));
      return;
    }
    const int band = split_bands_++;
    split_band(plan_.mesh_size, rows, shard_of, cuts_, [&](int k, std::span<const BandCut> run) {
      const int64_t d0 = run.front().dst, d1 = run.back().dst + run.back().e - run.back().b;
      Unit u{task_rows(side, t, d0, d1), k, band};
      if (d0 == r0) {
        u.task.scale_offset = scale_offset;
        u.task.scale_bytes = uint64_t(scale_cols) * 4;
      }
      for (const BandCut& c : run) {
        const PlanPiece& p = pieces[c.piece];
        u.task.pieces.push_back({p.param, c.b, c.e, p.col_begin, p.col_end, c.dst});
      }
      units.push_back(std::move(u));
    });
  });
}

std::vector<Unit> Planner::cut(const std::string& family) {
  std::vector<Unit> units;
  for (const ReceiverSide& side : receivers_) {
    for (const ReceiverTensor& t : side.expected) {
      if (t.name != family) continue;
      if (t.quantized()) {
        cut_fp8(side, t, units);
      } else {
        cut_bf16(side, t, units);
      }
    }
  }
  return units;
}

// The mesh whose ranks have the fewest bytes so far (ties to the first).
int Planner::least_loaded_mesh() {
  std::vector<uint64_t> mesh_load(size_t(plan_.num_meshes), 0);
  for (const PlanTrainer& t : plan_.trainers) mesh_load[size_t(t.mesh_id)] += load_[t.rank];
  return int(std::min_element(mesh_load.begin(), mesh_load.end()) - mesh_load.begin());
}

// Every task's sender by the fewest bytes so far: a whole band's from its mesh rank in any
// mesh, a split band's sub-bands from one mesh, chosen at its first, whose shared maxima get
// the band's blocks.
void Planner::assign(std::vector<Unit>& units) {
  int band = -1, band_mesh = -1;
  int64_t band_maxima = -1;
  for (Unit& u : units) {
    if (u.band >= 0 && u.band != band) {
      band = u.band;
      band_mesh = least_loaded_mesh();
      band_maxima = plan_.maxima_floats[size_t(band_mesh)];
      plan_.maxima_floats[size_t(band_mesh)] += fp8_block_count(u.task.cols);
    }
    int best = -1;
    for (const PlanTrainer& t : plan_.trainers) {
      const bool eligible = t.mesh_rank == u.mesh_rank && (u.band < 0 || t.mesh_id == band_mesh);
      if (eligible && fewer_bytes(t.rank, load_[t.rank], best, best < 0 ? 0 : load_[best])) {
        best = t.rank;
      }
    }
    WL_CHECK_GE(best, 0);
    if (u.band >= 0) u.task.maxima = band_maxima;
    u.task.sender = best;
    load_[best] += u.task.total_bytes();
    plan_.tasks.push_back(std::move(u.task));
  }
}

Result<Plan> Planner::run() {
  WL_RETURN_IF_ERROR(check_config());
  std::set<std::pair<int, int>> seats;
  for (const RankMeta* t : trainers_) WL_RETURN_IF_ERROR(check_trainer(*t, seats));
  WL_RETURN_IF_ERROR(check_splits());
  for (ReceiverSide& side : receivers_) WL_RETURN_IF_ERROR(check_receiver(side));
  for (const PlanTrainer& t : plan_.trainers) load_[t.rank] = 0;
  plan_.maxima_floats.assign(size_t(plan_.num_meshes), 0);
  for (const auto& family : families()) {
    std::vector<Unit> units = cut(family.second);
    assign(units);
  }
  return std::move(plan_);
}

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

Result<Plan> make_plan(std::span<const RankMeta> ranks) { return Planner(ranks).run(); }

// ---- JSON ---------------------------------------------------------------------------------

std::string plan_to_json(const Plan& p) {
  json j = new_record(Plan::kFormat);
  if (!p.config_json.empty()) {
    j["config"] = json::parse(p.config_json);
  } else {
    j["layout"] = p.layout_name;
  }
  j["mesh_size"] = p.mesh_size;
  j["num_meshes"] = p.num_meshes;
  json ts = json::array();
  for (const PlanTrainer& t : p.trainers) {
    ts.push_back({{"rank", t.rank}, {"mesh", t.mesh_id}, {"mesh_rank", t.mesh_rank}});
  }
  j["trainers"] = ts;
  json rs = json::array();
  for (const PlanReceiver& r : p.receivers) {
    rs.push_back(
        {{"rank", r.rank},
         {"engine", r.engine},
         {"tp", r.tp},
         {"tp_rank", r.tp_rank},
         {"ep", r.ep},
         {"ep_rank", r.ep_rank},
         {"weight_format", weight_format_name(r.format)},
         {"epoch", u64_to_json(r.epoch)},
         {"worker_address", to_hex(r.worker_address)},
         {"slot_address", {u64_to_json(r.slot_address[0]), u64_to_json(r.slot_address[1])}},
         {"slot_bytes", u64_to_json(r.slot_bytes)},
         {"rkey", to_hex(r.rkey)}});
  }
  j["receivers"] = rs;
  j["maxima_floats"] = p.maxima_floats;
  json ks = json::array();
  for (const PlanTask& k : p.tasks) {
    json pieces = json::array();
    for (const PlanPiece& q : k.pieces) {
      pieces.push_back({{"param", q.param},
                        {"rows", {q.row_begin, q.row_end}},
                        {"cols", {q.col_begin, q.col_end}},
                        {"dst_row", q.dst_row}});
    }
    ks.push_back({{"sender", k.sender},
                  {"receiver", k.receiver},
                  {"tensor", k.tensor},
                  {"expert", k.expert},
                  {"maxima", k.maxima},
                  {"rows", {k.row_begin, k.row_end}},
                  {"cols", k.cols},
                  {"dtype", dtype_name(k.dtype)},
                  {"dst_offset", k.dst_offset},
                  {"bytes", k.bytes},
                  {"scale_offset", k.scale_offset},
                  {"scale_bytes", k.scale_bytes},
                  {"pieces", pieces}});
  }
  j["tasks"] = ks;
  return j.dump(1);
}

namespace {

PlanReceiver receiver_from_json(const json& r) {
  auto f = weight_format_from_name(r.at("weight_format").get<std::string>());
  if (!f) throw_field_error(r.at("weight_format"), "unknown weight format");
  return {int32_field(r.at("rank")),
          int32_field(r.at("engine")),
          int32_field(r.at("tp")),
          int32_field(r.at("tp_rank")),
          r.contains("ep") ? int32_field(r.at("ep")) : 1,
          r.contains("ep_rank") ? int32_field(r.at("ep_rank")) : 0,
          *f,
          u64_field(r.at("epoch")),
          hex_field(r.at("worker_address")),
          {u64_field(r.at("slot_address").at(0)), u64_field(r.at("slot_address").at(1))},
          u64_field(r.at("slot_bytes")),
          hex_field(r.at("rkey"))};
}

PlanTask task_from_json(const json& k) {
  PlanTask t;
  t.sender = int32_field(k.at("sender"));
  t.receiver = int32_field(k.at("receiver"));
  t.tensor = k.at("tensor").get<std::string>();
  t.expert = k.at("expert").get<bool>();
  t.maxima = int_field(k.at("maxima"));
  t.row_begin = int_field(k.at("rows").at(0));
  t.row_end = int_field(k.at("rows").at(1));
  t.cols = int_field(k.at("cols"));
  t.dtype = dtype_field(k.at("dtype"));
  t.dst_offset = uint_field(k.at("dst_offset"));
  t.bytes = uint_field(k.at("bytes"));
  t.scale_offset = uint_field(k.at("scale_offset"));
  t.scale_bytes = uint_field(k.at("scale_bytes"));
  for (const json& q : k.at("pieces")) {
    t.pieces.push_back({q.at("param").get<std::string>(), int_field(q.at("rows").at(0)),
                        int_field(q.at("rows").at(1)), int_field(q.at("cols").at(0)),
                        int_field(q.at("cols").at(1)), int_field(q.at("dst_row"))});
  }
  return t;
}

}  // namespace

Result<Plan> plan_from_json(std::string_view text, std::string_view where) {
  const std::string w(where);
  return read_record<Plan>(text, where, Plan::kFormat, [&](const json& j) -> Result<Plan> {
    Plan p;
    // Our model's config, or the name of the layout spec the trainers hold: one of the two.
    if (j.contains("config") == j.contains("layout")) {
      throw_field_error(j, "a plan needs exactly one of \"config\" and \"layout\"");
    }
    if (j.contains("config")) {
      WL_ASSIGN_OR_RETURN(model::ModelConfig c, model::parse_config(j.at("config").dump(), w));
      p.config_json = model::config_to_json(c);
    } else {
      p.layout_name = j.at("layout").get<std::string>();
    }
    p.mesh_size = int32_field(j.at("mesh_size"));
    p.num_meshes = int32_field(j.at("num_meshes"));
    for (const json& t : j.at("trainers")) {
      p.trainers.push_back(
          {int32_field(t.at("rank")), int32_field(t.at("mesh")), int32_field(t.at("mesh_rank"))});
      if (p.trainers.back().mesh_id < 0 || p.trainers.back().mesh_id >= p.num_meshes) {
        throw_field_error(t.at("mesh"), "is not one of the plan's meshes");
      }
    }
    for (const json& r : j.at("receivers")) p.receivers.push_back(receiver_from_json(r));
    for (const json& m : j.at("maxima_floats")) {
      p.maxima_floats.push_back(int_field_in(m, 0, int64_t(1) << 40));
    }
    if (p.maxima_floats.size() != size_t(p.num_meshes)) {
      throw_field_error(j.at("maxima_floats"), "needs one count per mesh");
    }
    for (const json& k : j.at("tasks")) {
      PlanTask t = task_from_json(k);
      const PlanTrainer* sender = p.find_trainer(t.sender);
      if (sender == nullptr || p.find_receiver(t.receiver) == nullptr) {
        throw_field_error(k, "names an unknown sender or receiver");
      }
      // A sub-band: fp8 rows inside one 128-row band, its blocks inside its mesh's maxima.
      if (t.maxima < -1 ||
          (t.maxima >= 0 &&
           (!t.quantized() || t.cols <= 0 || t.cols > (int64_t(1) << 40) || t.row_begin < 0 ||
            t.row_end <= t.row_begin ||
            t.row_begin / kFp8BlockSize != (t.row_end - 1) / kFp8BlockSize ||
            t.maxima > p.maxima_floats[size_t(sender->mesh_id)] - fp8_block_count(t.cols)))) {
        throw_field_error(k, "reads block maxima outside its mesh's shared maxima");
      }
      p.tasks.push_back(std::move(t));
    }
    return p;
  });
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
