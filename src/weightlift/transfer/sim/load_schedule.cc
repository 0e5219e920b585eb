// schedule_loads: the planner's rules (plan/cutting.h), one family at a time, adding each task
// to counters instead of emitting it.
#include "weightlift/transfer/sim/load_schedule.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

#include "weightlift/transfer/plan/cutting.h"

namespace wl::transfer {
namespace {

struct Source {  // a SourceSlice with its parameter resolved
  int param = 0;
  int64_t row_begin = 0, row_end = 0, dst_row = 0;
};

// A task before its sender is chosen (plan/planner.cc's Unit, without names or pieces).
struct Unit {
  int receiver = 0;
  const ReceiverTensor* tensor = nullptr;
  int64_t row_begin = 0, row_end = 0;
  uint64_t bytes = 0, scale_bytes = 0, prepare = 0;
  int messages = 1;
  int placement = -1;  // of the direct sender
  int direct = -1;     // mesh rank that holds every row it reads; -1: needs the gather
};

struct Piece {  // parameter rows [b, e) one fp8 band reads
  int param = 0;
  int64_t param_rows = 0, b = 0, e = 0;
};

struct Family {
  bool expert = false;
  std::vector<std::pair<int, int>> members;  // (receiver, tensor index in its layout)
};

void resize(PhaseLoads& p, size_t trainers, size_t receivers) {
  for (auto* v :
       {&p.sent, &p.messages, &p.prepare, &p.gather_nvlink, &p.gather_nic, &p.gather_calls}) {
    v->assign(trainers, 0);
  }
  p.received.assign(receivers, 0);
  p.received_messages.assign(receivers, 0);
}

const std::string kWhere = "transfer schedule: ";

// schedule_loads' state: the checked input, its families in order, the bytes per trainer.
class Scheduler {
 public:
  explicit Scheduler(const ScheduleInput& in) : in_(in), load_(size_t(in.trainers), 0) {}
  Result<ScheduleLoads> run();

 private:
  Status check_placements() const;
  Status resolve_sources();
  Status make_families();
  void cut_bf16(int r, const ReceiverTensor& t, const std::vector<Source>& src);
  void cut_fp8(int r, const ReceiverTensor& t, const std::vector<Source>& src);
  Result<const std::vector<int>*> gather(const Family& fam, PhaseLoads& ph);
  void assign(const std::vector<int>* gather_mesh, PhaseLoads& ph);
  int mesh_size(int param) const {
    return int(in_.placements[size_t(in_.params[size_t(param)].placement)].meshes[0].size());
  }

  const ScheduleInput& in_;
  std::unordered_map<std::string_view, int> param_index_;
  std::vector<std::vector<std::vector<Source>>> sources_;  // by layout, by tensor
  std::vector<Family> families_;
  std::vector<int> order_;      // families, dense before expert
  std::vector<uint64_t> load_;  // bytes assigned so far, by trainer
  size_t shard_es_ = 0;
  // Per family, reused:
  std::vector<Unit> units_;
  std::vector<int> gather_params_;
  std::vector<Piece> pieces_;
};

Status Scheduler::check_placements() const {
  if (in_.trainers < 1 || in_.gpus_per_node < 1) {
    return invalid_argument(kWhere + "need at least one trainer and one GPU per node");
  }
  for (size_t i = 0; i < in_.placements.size(); ++i) {
    const Placement& pl = in_.placements[i];
    if (pl.meshes.empty() || pl.meshes[0].empty()) {
      return invalid_argument(kWhere + "placement " + std::to_string(i) + " has no mesh");
    }
    for (const auto& mesh : pl.meshes) {
      if (mesh.size() != pl.meshes[0].size()) {
        return invalid_argument(kWhere + "placement " + std::to_string(i) +
                                " has meshes of different sizes");
      }
      for (int t : mesh) {
        if (t < 0 || t >= in_.trainers) {
          return invalid_argument(kWhere + "placement " + std::to_string(i) + " names trainer " +
                                  std::to_string(t) + " of " + std::to_string(in_.trainers));
        }
      }
    }
  }
  return ok_status();
}

// Every source resolved to its parameter once per distinct layout, and checked to fit.
Status Scheduler::resolve_sources() {
  for (size_t i = 0; i < in_.params.size(); ++i) {
    const ScheduleParam& p = in_.params[i];
    if (p.placement < 0 || size_t(p.placement) >= in_.placements.size()) {
      return invalid_argument(kWhere + "parameter '" + p.name + "' has no placement");
    }
    param_index_.emplace(p.name, int(i));
  }
  sources_.resize(in_.layouts.size());
  for (size_t l = 0; l < in_.layouts.size(); ++l) {
    for (const ReceiverTensor& t : in_.layouts[l]) {
      std::vector<Source>& out = sources_[l].emplace_back();
      for (const SourceSlice& s : t.sources) {
        auto it = param_index_.find(s.param);
        if (it == param_index_.end()) {
          return not_found(kWhere + "receiver tensor '" + t.name + "' reads parameter '" + s.param +
                           "', which no trainer holds");
        }
        const ScheduleParam& p = in_.params[size_t(it->second)];
        if (s.row_begin < 0 || s.row_end > p.rows || s.col_begin < 0 || s.col_end > p.cols ||
            s.col_end - s.col_begin != t.cols || s.dst_row + s.rows() > t.rows) {
          return invalid_argument(kWhere + "receiver tensor '" + t.name + "' reads rows [" +
                                  std::to_string(s.row_begin) + ", " + std::to_string(s.row_end) +
                                  ") of '" + s.param + "', which does not fit");
        }
        out.push_back({it->second, s.row_begin, s.row_end, s.dst_row});
      }
    }
  }
  return ok_status();
}

// Families in order of first appearance over the receivers, dense before expert (cutting.h).
Status Scheduler::make_families() {
  std::vector<std::vector<int>> family_of(in_.layouts.size());
  std::unordered_map<std::string_view, int> family_index;
  for (size_t r = 0; r < in_.receiver_layout.size(); ++r) {
    const int l = in_.receiver_layout[r];
    if (l < 0 || size_t(l) >= in_.layouts.size()) {
      return invalid_argument(kWhere + "receiver " + std::to_string(r) + " has no layout");
    }
    const std::vector<ReceiverTensor>& lay = in_.layouts[size_t(l)];
    std::vector<int>& fam = family_of[size_t(l)];
    if (fam.empty()) {
      fam.assign(lay.size(), -1);
      for (size_t i = 0; i < lay.size(); ++i) {
        if (lay[i].sources.empty()) continue;  // scales ride along with their tensor
        auto [it, fresh] = family_index.emplace(lay[i].name, int(families_.size()));
        if (fresh) families_.push_back({lay[i].expert, {}});
        fam[i] = it->second;
      }
    }
    for (size_t i = 0; i < lay.size(); ++i) {
      if (fam[i] >= 0) families_[size_t(fam[i])].members.push_back({int(r), int(i)});
    }
  }
  order_.resize(families_.size());
  std::iota(order_.begin(), order_.end(), 0);
  dense_before_expert(order_, [&](int f) { return families_[size_t(f)].expert; });
  return ok_status();
}

void Scheduler::cut_bf16(int r, const ReceiverTensor& t, const std::vector<Source>& src) {
  const size_t es = dtype_size(t.dtype);
  const uint64_t cast = t.dtype == in_.trainer_dtype ? 0 : shard_es_;
  for (const Source& s : src) {
    const ScheduleParam& p = in_.params[size_t(s.param)];
    const int ms = mesh_size(s.param);
    cut_at_shards(
        ms, [&](int k) { return shard_rows(p.rows, ms, k); }, s.row_begin, s.row_end, s.dst_row,
        [&](int k, int64_t b, int64_t e, int64_t d0) {
          const uint64_t elems = uint64_t((e - b) * t.cols);
          units_.push_back({.receiver = r,
                            .tensor = &t,
                            .row_begin = d0,
                            .row_end = d0 + e - b,
                            .bytes = elems * es,
                            .prepare = elems * cast,
                            .placement = p.placement,
                            .direct = k});
        });
  }
}

void Scheduler::cut_fp8(int r, const ReceiverTensor& t, const std::vector<Source>& src) {
  const size_t es = dtype_size(t.dtype);
  const int64_t scale_cols = (t.cols + kFp8BlockSize - 1) / kFp8BlockSize;
  for_each_band(t.rows, [&](int64_t r0, int64_t r1) {
    const uint64_t elems = uint64_t((r1 - r0) * t.cols);
    Unit& u = units_.emplace_back();  // built in place: this runs per 128-row band
    u.receiver = r;
    u.tensor = &t;
    u.row_begin = r0;
    u.row_end = r1;
    u.bytes = elems * es;
    u.scale_bytes = uint64_t(scale_cols) * 4;
    u.prepare = elems * shard_es_;
    u.messages = 2;
    pieces_.clear();
    for (const Source& s : src) {
      int64_t b = 0, e = 0, dst = 0;
      if (band_piece(s.row_begin, s.row_end - s.row_begin, s.dst_row, r0, r1, &b, &e, &dst)) {
        pieces_.push_back({s.param, in_.params[size_t(s.param)].rows, b, e});
      }
    }
    // A direct sender holds every piece in its own shards: one placement, one mesh rank.
    const int placement = in_.params[size_t(pieces_.front().param)].placement;
    const bool one_placement = std::all_of(pieces_.begin(), pieces_.end(), [&](const Piece& q) {
      return in_.params[size_t(q.param)].placement == placement;
    });
    if (one_placement) {
      const int ms = mesh_size(pieces_.front().param);
      u.direct = direct_mesh_rank(
          ms, pieces_, [&](const Piece& q, int k) { return shard_rows(q.param_rows, ms, k); });
      u.placement = placement;
    }
    if (u.direct >= 0) return;
    for (const Piece& q : pieces_) {
      if (std::find(gather_params_.begin(), gather_params_.end(), q.param) ==
          gather_params_.end()) {
        gather_params_.push_back(q.param);
      }
    }
  });
}

// The family's gather, if any band needs one: on the holding mesh with the fewest bytes. Its
// full_tensor() has every rank fetch every other rank's shard, from peers on its node over
// NVLink and from the others over its NIC (and serve its own shard the same way).
Result<const std::vector<int>*> Scheduler::gather(const Family& fam, PhaseLoads& ph) {
  if (gather_params_.empty()) return nullptr;
  const int pl = in_.params[size_t(gather_params_[0])].placement;
  uint64_t bytes = 0;
  for (int p : gather_params_) {
    const ScheduleParam& sp = in_.params[size_t(p)];
    if (sp.placement != pl) {
      const auto [r, ti] = fam.members[0];
      return invalid_argument(kWhere + "receiver tensor '" +
                              in_.layouts[size_t(in_.receiver_layout[size_t(r)])][size_t(ti)].name +
                              "' needs a gather of parameters on different placements ('" +
                              in_.params[size_t(gather_params_[0])].name + "', '" + sp.name + "')");
    }
    bytes += uint64_t(sp.rows * sp.cols) * shard_es_;
  }
  const std::vector<int>* mesh = nullptr;
  uint64_t best_load = 0;
  for (const std::vector<int>& m : in_.placements[size_t(pl)].meshes) {
    uint64_t sum = 0;
    for (int t : m) sum += load_[size_t(t)];
    if (mesh == nullptr || sum < best_load) {
      mesh = &m;
      best_load = sum;
    }
  }
  auto node = [&](int t) { return t / in_.gpus_per_node; };
  const uint64_t m = mesh->size();
  for (int t : *mesh) {
    uint64_t local = 0;
    for (int u : *mesh) local += node(u) == node(t);
    ph.gather_nvlink[size_t(t)] += bytes * (local - 1) / m;
    ph.gather_nic[size_t(t)] += bytes * (m - local) / m;
    ++ph.gather_calls[size_t(t)];
  }
  ++ph.gathers;
  return mesh;
}

// Every unit's sender by the fewest bytes so far, and its bytes on the counters.
void Scheduler::assign(const std::vector<int>* gather_mesh, PhaseLoads& ph) {
  for (const Unit& u : units_) {
    int sender = -1;
    auto consider = [&](int t) {
      if (fewer_bytes(t, load_[size_t(t)], sender, sender < 0 ? 0 : load_[size_t(sender)])) {
        sender = t;
      }
    };
    if (u.direct >= 0) {
      for (const std::vector<int>& mesh : in_.placements[size_t(u.placement)].meshes) {
        consider(mesh[size_t(u.direct)]);
      }
    } else {
      for (int t : *gather_mesh) consider(t);
    }
    const uint64_t total = u.bytes + u.scale_bytes;
    load_[size_t(sender)] += total;
    ph.sent[size_t(sender)] += total;
    ph.messages[size_t(sender)] += uint64_t(u.messages);
    ph.prepare[size_t(sender)] += u.prepare;
    ph.received[size_t(u.receiver)] += total;
    ph.received_messages[size_t(u.receiver)] += uint64_t(u.messages);
    ++ph.tasks;
    (u.direct >= 0 ? ph.direct_bytes : ph.gathered_bytes) += total;
    if (total > ph.largest_task) {
      ph.largest_task = total;
      ph.largest_task_prepare = u.prepare;
      ph.largest_task_messages = uint64_t(u.messages);
    }
    if (in_.on_task) {
      in_.on_task({sender, u.receiver, u.tensor, u.row_begin, u.row_end, u.bytes, u.scale_bytes,
                   u.direct < 0});
    }
  }
}

Result<ScheduleLoads> Scheduler::run() {
  WL_RETURN_IF_ERROR(check_placements());
  WL_RETURN_IF_ERROR(resolve_sources());
  WL_RETURN_IF_ERROR(make_families());
  ScheduleLoads out;
  out.families = families_.size();
  for (PhaseLoads& p : out.phase) resize(p, size_t(in_.trainers), in_.receiver_layout.size());
  shard_es_ = dtype_size(in_.trainer_dtype);
  for (size_t fi = 0; fi < order_.size(); ++fi) {
    if (in_.progress && fi % 512 == 0) in_.progress(double(fi) / double(order_.size()));
    const Family& fam = families_[size_t(order_[fi])];
    PhaseLoads& ph = out.phase[fam.expert ? 1 : 0];
    units_.clear();
    gather_params_.clear();
    for (auto [r, ti] : fam.members) {
      const int l = in_.receiver_layout[size_t(r)];
      const ReceiverTensor& t = in_.layouts[size_t(l)][size_t(ti)];
      const std::vector<Source>& src = sources_[size_t(l)][size_t(ti)];
      if (t.quantized()) {
        cut_fp8(r, t, src);
      } else {
        cut_bf16(r, t, src);
      }
    }
    WL_ASSIGN_OR_RETURN(const std::vector<int>* gather_mesh, gather(fam, ph));
    assign(gather_mesh, ph);
  }
  if (in_.progress) in_.progress(1.0);
  return out;
}

}  // namespace

Result<ScheduleLoads> schedule_loads(const ScheduleInput& in) { return Scheduler(in).run(); }

}  // namespace wl::transfer
