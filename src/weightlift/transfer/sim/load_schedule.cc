// schedule_loads: plan/planner.cc's rules, one family at a time, adding each task to counters.
#include "weightlift/transfer/sim/load_schedule.h"

#include <algorithm>
#include <unordered_map>

#include "weightlift/transfer/layout/sharded_tensor.h"

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
  int64_t b = 0, e = 0;
};

struct Family {
  bool expert = false;
  std::vector<std::pair<int, int>> members;  // (receiver, tensor index in its layout)
};

void resize(PhaseLoads& p, size_t trainers, size_t receivers) {
  for (auto* v : {&p.sent, &p.messages, &p.prepare, &p.gather_nvlink, &p.gather_nic}) {
    v->assign(trainers, 0);
  }
  p.received.assign(receivers, 0);
  p.received_messages.assign(receivers, 0);
}

}  // namespace

Result<ScheduleLoads> schedule_loads(const ScheduleInput& in) {
  const std::string where = "transfer schedule: ";
  if (in.trainers < 1 || in.gpus_per_node < 1) {
    return invalid_argument(where + "need at least one trainer and one GPU per node");
  }
  for (size_t i = 0; i < in.placements.size(); ++i) {
    const Placement& pl = in.placements[i];
    if (pl.meshes.empty() || pl.meshes[0].empty()) {
      return invalid_argument(where + "placement " + std::to_string(i) + " has no mesh");
    }
    for (const auto& mesh : pl.meshes) {
      if (mesh.size() != pl.meshes[0].size()) {
        return invalid_argument(where + "placement " + std::to_string(i) +
                                " has meshes of different sizes");
      }
      for (int t : mesh) {
        if (t < 0 || t >= in.trainers) {
          return invalid_argument(where + "placement " + std::to_string(i) + " names trainer " +
                                  std::to_string(t) + " of " + std::to_string(in.trainers));
        }
      }
    }
  }
  std::unordered_map<std::string_view, int> param_index;
  for (size_t i = 0; i < in.params.size(); ++i) {
    const ScheduleParam& p = in.params[i];
    if (p.placement < 0 || size_t(p.placement) >= in.placements.size()) {
      return invalid_argument(where + "parameter '" + p.name + "' has no placement");
    }
    param_index.emplace(p.name, int(i));
  }

  // Resolve every source once per distinct layout.
  std::vector<std::vector<std::vector<Source>>> sources(in.layouts.size());
  for (size_t l = 0; l < in.layouts.size(); ++l) {
    for (const ReceiverTensor& t : in.layouts[l]) {
      std::vector<Source>& out = sources[l].emplace_back();
      for (const SourceSlice& s : t.sources) {
        auto it = param_index.find(s.param);
        if (it == param_index.end()) {
          return not_found(where + "receiver tensor '" + t.name + "' reads parameter '" + s.param +
                           "', which no trainer holds");
        }
        const ScheduleParam& p = in.params[size_t(it->second)];
        if (s.row_begin < 0 || s.row_end > p.rows || s.col_begin < 0 || s.col_end > p.cols ||
            s.col_end - s.col_begin != t.cols || s.dst_row + s.rows() > t.rows) {
          return invalid_argument(where + "receiver tensor '" + t.name + "' reads rows [" +
                                  std::to_string(s.row_begin) + ", " + std::to_string(s.row_end) +
                                  ") of '" + s.param + "', which does not fit");
        }
        out.push_back({it->second, s.row_begin, s.row_end, s.dst_row});
      }
    }
  }

  // Families in order of first appearance over the receivers, dense before expert.
  std::vector<Family> families;
  std::vector<std::vector<int>> family_of(in.layouts.size());
  std::unordered_map<std::string_view, int> family_index;
  for (size_t r = 0; r < in.receiver_layout.size(); ++r) {
    const int l = in.receiver_layout[r];
    if (l < 0 || size_t(l) >= in.layouts.size()) {
      return invalid_argument(where + "receiver " + std::to_string(r) + " has no layout");
    }
    const std::vector<ReceiverTensor>& lay = in.layouts[size_t(l)];
    std::vector<int>& fam = family_of[size_t(l)];
    if (fam.empty()) {
      fam.assign(lay.size(), -1);
      for (size_t i = 0; i < lay.size(); ++i) {
        if (lay[i].sources.empty()) continue;  // scales ride along with their tensor
        auto [it, fresh] = family_index.emplace(lay[i].name, int(families.size()));
        if (fresh) families.push_back({lay[i].expert, {}});
        fam[i] = it->second;
      }
    }
    for (size_t i = 0; i < lay.size(); ++i) {
      if (fam[i] >= 0) families[size_t(fam[i])].members.push_back({int(r), int(i)});
    }
  }
  std::vector<int> order(families.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return families[size_t(a)].expert < families[size_t(b)].expert;
  });

  ScheduleLoads out;
  out.families = families.size();
  for (PhaseLoads& p : out.phase) resize(p, size_t(in.trainers), in.receiver_layout.size());
  const size_t shard_es = dtype_size(in.trainer_dtype);
  std::vector<uint64_t> load(size_t(in.trainers), 0);
  auto least_loaded = [&](int best, int t) {
    return best < 0 || load[size_t(t)] < load[size_t(best)] ||
           (load[size_t(t)] == load[size_t(best)] && t < best);
  };
  auto mesh_size = [&](int param) {
    return int(in.placements[size_t(in.params[size_t(param)].placement)].meshes[0].size());
  };
  auto node = [&](int t) { return t / in.gpus_per_node; };

  std::vector<Unit> units;
  std::vector<int> gather_params;
  std::vector<Piece> pieces;
  for (size_t fi = 0; fi < order.size(); ++fi) {
    if (in.progress && fi % 512 == 0) in.progress(double(fi) / double(order.size()));
    const Family& fam = families[size_t(order[fi])];
    PhaseLoads& ph = out.phase[fam.expert ? 1 : 0];
    units.clear();
    gather_params.clear();
    for (auto [r, ti] : fam.members) {
      const int l = in.receiver_layout[size_t(r)];
      const ReceiverTensor& t = in.layouts[size_t(l)][size_t(ti)];
      const std::vector<Source>& src = sources[size_t(l)][size_t(ti)];
      const size_t es = dtype_size(t.dtype);
      if (!t.quantized()) {
        const uint64_t cast = t.dtype == in.trainer_dtype ? 0 : shard_es;
        for (const Source& s : src) {
          const ScheduleParam& p = in.params[size_t(s.param)];
          const int m = mesh_size(s.param);
          for (int k = 0; k < m; ++k) {
            const ShardRows sh = shard_rows(p.rows, m, k);
            const int64_t b = std::max(s.row_begin, sh.begin), e = std::min(s.row_end, sh.end);
            if (b >= e) continue;
            const int64_t d0 = s.dst_row + b - s.row_begin;
            const uint64_t elems = uint64_t((e - b) * t.cols);
            units.push_back({.receiver = r,
                             .tensor = &t,
                             .row_begin = d0,
                             .row_end = d0 + e - b,
                             .bytes = elems * es,
                             .prepare = elems * cast,
                             .placement = p.placement,
                             .direct = k});
          }
        }
        continue;
      }
      const int64_t scale_cols = (t.cols + kFp8BlockSize - 1) / kFp8BlockSize;
      for (int64_t r0 = 0; r0 < t.rows; r0 += kFp8BlockSize) {
        const int64_t r1 = std::min(t.rows, r0 + kFp8BlockSize);
        const uint64_t elems = uint64_t((r1 - r0) * t.cols);
        Unit& u = units.emplace_back();  // built in place: this loop runs per 128-row band
        u.receiver = r;
        u.tensor = &t;
        u.row_begin = r0;
        u.row_end = r1;
        u.bytes = elems * es;
        u.scale_bytes = uint64_t(scale_cols) * 4;
        u.prepare = elems * shard_es;
        u.messages = 2;
        // The band's pieces: parameter rows [b, e) of each source it overlaps.
        pieces.clear();
        for (const Source& s : src) {
          const int64_t b = std::max(s.dst_row, r0);
          const int64_t e = std::min(s.dst_row + (s.row_end - s.row_begin), r1);
          if (b < e) {
            pieces.push_back({s.param, s.row_begin + b - s.dst_row, s.row_begin + e - s.dst_row});
          }
        }
        // A direct sender holds every piece in its own shards: one placement, one mesh rank.
        const int placement = in.params[size_t(pieces.front().param)].placement;
        bool one_placement = true;
        for (const Piece& q : pieces) {
          one_placement = one_placement && in.params[size_t(q.param)].placement == placement;
        }
        if (one_placement) {
          const int m = mesh_size(pieces.front().param);
          for (int k = 0; k < m && u.direct < 0; ++k) {
            bool all = true;
            for (const Piece& q : pieces) {
              all = all && shard_rows(in.params[size_t(q.param)].rows, m, k).contains(q.b, q.e);
            }
            if (all) u.direct = k;
          }
          u.placement = placement;
        }
        if (u.direct < 0) {
          for (const Piece& q : pieces) {
            if (std::find(gather_params.begin(), gather_params.end(), q.param) ==
                gather_params.end()) {
              gather_params.push_back(q.param);
            }
          }
        }
      }
    }

    // The family's gather, if any band needs one: on the holding mesh with the fewest bytes.
    const std::vector<int>* gather_mesh = nullptr;
    if (!gather_params.empty()) {
      const int pl = in.params[size_t(gather_params[0])].placement;
      uint64_t bytes = 0;
      for (int p : gather_params) {
        const ScheduleParam& sp = in.params[size_t(p)];
        if (sp.placement != pl) {
          return invalid_argument(
              where + "receiver tensor '" +
              in.layouts[size_t(in.receiver_layout[size_t(fam.members[0].first)])]
                        [size_t(fam.members[0].second)]
                            .name +
              "' needs a gather of parameters on different placements ('" +
              in.params[size_t(gather_params[0])].name + "', '" + sp.name + "')");
        }
        bytes += uint64_t(sp.rows * sp.cols) * shard_es;
      }
      uint64_t best_load = 0;
      for (const std::vector<int>& mesh : in.placements[size_t(pl)].meshes) {
        uint64_t sum = 0;
        for (int t : mesh) sum += load[size_t(t)];
        if (gather_mesh == nullptr || sum < best_load) {
          gather_mesh = &mesh;
          best_load = sum;
        }
      }
      // full_tensor(): every rank fetches every other rank's shard, from peers on its node
      // over NVLink and from the others over its NIC (and serves its own shard the same way).
      const uint64_t m = gather_mesh->size();
      for (int t : *gather_mesh) {
        uint64_t local = 0;
        for (int u : *gather_mesh) local += node(u) == node(t);
        ph.gather_nvlink[size_t(t)] += bytes * (local - 1) / m;
        ph.gather_nic[size_t(t)] += bytes * (m - local) / m;
      }
      ++ph.gathers;
    }

    for (const Unit& u : units) {
      int sender = -1;
      if (u.direct >= 0) {
        for (const std::vector<int>& mesh : in.placements[size_t(u.placement)].meshes) {
          if (least_loaded(sender, mesh[size_t(u.direct)])) sender = mesh[size_t(u.direct)];
        }
      } else {
        for (int t : *gather_mesh) {
          if (least_loaded(sender, t)) sender = t;
        }
      }
      const uint64_t total = u.bytes + u.scale_bytes;
      load[size_t(sender)] += total;
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
      if (in.on_task) {
        in.on_task({sender, u.receiver, u.tensor, u.row_begin, u.row_end, u.bytes, u.scale_bytes,
                    u.direct < 0});
      }
    }
  }
  if (in.progress) in.progress(1.0);
  return out;
}

}  // namespace wl::transfer
