// schedule_loads: the planner's rules (plan/cutting.h), one family at a time, adding each task
// to counters instead of emitting it.
#include "weightlift/transfer/sim/load_schedule.h"

#include <algorithm>
#include <map>
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
  int placement = -1;  // of its sender
  int mesh_rank = 0;   // which rank of a mesh holds every row it reads
  int band = -1;       // a sub-band: its split band's number, the same for all its sub-bands
};

struct Piece {  // parameter rows [b, e) one fp8 band reads, landing at receiver row dst
  int param = 0;
  int64_t param_rows = 0, b = 0, e = 0, dst = 0;
};

struct Family {
  bool expert = false;
  std::vector<std::pair<int, int>> members;  // (receiver, tensor index in its layout)
};

void resize(PhaseLoads& p, size_t trainers, size_t receivers) {
  for (auto* v :
       {&p.sent, &p.messages, &p.prepare, &p.maxima_rounds, &p.maxima_bytes, &p.maxima_prepare}) {
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
  const std::vector<int>& split_mesh(int placement, int64_t blocks, PhaseLoads& ph);
  void assign(PhaseLoads& ph, PhaseLoads& before_puts);
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
  int split_bands_ = 0;                                 // bands split so far
  std::map<const std::vector<int>*, uint64_t> maxima_;  // floats per mesh that splits bands
  Status error_;                                        // the first band no mesh can split
  // Per family, reused:
  std::vector<Unit> units_;
  std::vector<Piece> pieces_;
  std::vector<BandCut> cuts_;
};

Status Scheduler::check_placements() const {
  if (in_.trainers < 1) return invalid_argument(kWhere + "need at least one trainer");
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
                            .mesh_rank = k});
        });
  }
}

void Scheduler::cut_fp8(int r, const ReceiverTensor& t, const std::vector<Source>& src) {
  const size_t es = dtype_size(t.dtype);
  const uint64_t scale_bytes = uint64_t(fp8_block_count(t.cols)) * 4;
  for_each_band(t.rows, [&](int64_t r0, int64_t r1) {
    pieces_.clear();
    for (const Source& s : src) {
      int64_t b = 0, e = 0, dst = 0;
      if (band_piece(s.row_begin, s.row_end - s.row_begin, s.dst_row, r0, r1, &b, &e, &dst)) {
        pieces_.push_back({s.param, in_.params[size_t(s.param)].rows, b, e, dst});
      }
    }
    // Rows [d0, d1) of the band as one task (built in place: this runs per 128-row band).
    auto add = [&](int placement, int mesh_rank, int band, int64_t d0, int64_t d1) {
      const uint64_t elems = uint64_t((d1 - d0) * t.cols);
      Unit& u = units_.emplace_back();
      u.receiver = r;
      u.tensor = &t;
      u.row_begin = d0;
      u.row_end = d1;
      u.bytes = elems * es;
      u.scale_bytes = d0 == r0 ? scale_bytes : 0;
      u.prepare = elems * shard_es_;
      u.messages = d0 == r0 ? 2 : 1;
      u.placement = placement;
      u.mesh_rank = mesh_rank;
      u.band = band;
    };
    // Every piece must sit on one placement for one mesh rank, or one mesh, to send the band.
    const int placement = in_.params[size_t(pieces_.front().param)].placement;
    for (const Piece& q : pieces_) {
      if (in_.params[size_t(q.param)].placement == placement) continue;
      if (error_.ok()) {
        error_ = invalid_argument(kWhere + "receiver tensor '" + t.name + "' rows [" +
                                  std::to_string(r0) + ", " + std::to_string(r1) +
                                  ") read parameters on different placements ('" +
                                  in_.params[size_t(pieces_.front().param)].name + "', '" +
                                  in_.params[size_t(q.param)].name + "')");
      }
      return;
    }
    const int ms = mesh_size(pieces_.front().param);
    auto shard_of = [&](const Piece& q, int k) { return shard_rows(q.param_rows, ms, k); };
    const int direct = direct_mesh_rank(ms, pieces_, shard_of);
    if (direct >= 0) {
      add(placement, direct, -1, r0, r1);
      return;
    }
    const int band = split_bands_++;
    split_band(ms, pieces_, shard_of, cuts_, [&](int k, std::span<const BandCut> run) {
      add(placement, k, band, run.front().dst, run.back().dst + run.back().e - run.back().b);
    });
  });
}

// A split band's mesh: the placement's mesh with the fewest bytes so far (ties to the first),
// whose maxima round then carries the band's blocks.
const std::vector<int>& Scheduler::split_mesh(int placement, int64_t blocks, PhaseLoads& ph) {
  const std::vector<int>* mesh = nullptr;
  uint64_t best_load = 0;
  for (const std::vector<int>& m : in_.placements[size_t(placement)].meshes) {
    uint64_t sum = 0;
    for (int t : m) sum += load_[size_t(t)];
    if (mesh == nullptr || sum < best_load) {
      mesh = &m;
      best_load = sum;
    }
  }
  maxima_[mesh] += uint64_t(blocks);
  ++ph.split_bands;
  return *mesh;
}

// Every unit's sender by the fewest bytes so far, and its bytes on the counters.
void Scheduler::assign(PhaseLoads& ph, PhaseLoads& before_puts) {
  int band = -1;
  const std::vector<int>* band_mesh = nullptr;
  for (const Unit& u : units_) {
    if (u.band >= 0 && u.band != band) {
      band = u.band;
      band_mesh = &split_mesh(u.placement, fp8_block_count(u.tensor->cols), ph);
    }
    int sender = -1;
    auto consider = [&](int t) {
      if (fewer_bytes(t, load_[size_t(t)], sender, sender < 0 ? 0 : load_[size_t(sender)])) {
        sender = t;
      }
    };
    if (u.band < 0) {
      for (const std::vector<int>& mesh : in_.placements[size_t(u.placement)].meshes) {
        consider(mesh[size_t(u.mesh_rank)]);
      }
    } else {
      consider((*band_mesh)[size_t(u.mesh_rank)]);
    }
    const uint64_t total = u.bytes + u.scale_bytes;
    load_[size_t(sender)] += total;
    ph.sent[size_t(sender)] += total;
    ph.messages[size_t(sender)] += uint64_t(u.messages);
    ph.prepare[size_t(sender)] += u.prepare;
    ph.received[size_t(u.receiver)] += total;
    ph.received_messages[size_t(u.receiver)] += uint64_t(u.messages);
    ++ph.tasks;
    (u.band < 0 ? ph.whole_bytes : ph.split_bytes) += total;
    if (u.band >= 0) before_puts.maxima_prepare[size_t(sender)] += u.prepare;
    if (total > ph.largest_task) {
      ph.largest_task = total;
      ph.largest_task_prepare = u.prepare;
      ph.largest_task_messages = uint64_t(u.messages);
    }
    if (in_.on_task) {
      in_.on_task({sender, u.receiver, u.tensor, u.row_begin, u.row_end, u.bytes, u.scale_bytes,
                   u.band >= 0});
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
    if (!error_.ok()) return error_;
    assign(ph, out.phase[0]);
  }
  for (const auto& [mesh, floats] : maxima_) {
    for (int t : *mesh) {
      ++out.phase[0].maxima_rounds[size_t(t)];
      out.phase[0].maxima_bytes[size_t(t)] += floats * 4;
    }
  }
  if (in_.progress) in_.progress(1.0);
  return out;
}

}  // namespace

Result<ScheduleLoads> schedule_loads(const ScheduleInput& in) { return Scheduler(in).run(); }

}  // namespace wl::transfer
