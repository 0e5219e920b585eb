// How an update is cut into tasks and who sends each: the rules the planner (planner.h) applies
// to emit every task, and the cluster schedule (sim/load_schedule.h) applies to count them at a
// scale where the tasks themselves would not fit in memory. One copy of the rules, so the two
// cannot drift apart (tests/transfer/simulate_test.cc checks they agree task for task).
//
//   bf16 (and the bf16 tensors of an fp8 receiver): each source slice is cut at the shard
//        boundaries of its parameter's mesh (torch.chunk's, or the RowSplit the trainers
//        hold it by, layout/sharded_tensor.h); every piece lies inside one mesh rank's shard,
//        so that rank sends it with no gather.
//   fp8: a block scale needs all 128 rows of its band, so a task is a 128-row band, sent by
//        the lowest mesh rank whose shards hold every row it reads. A band no mesh rank holds
//        whole is split at the shard boundaries into sub-bands (split_band), each sent by the
//        mesh rank that holds it, all of one mesh; they share the band's block maxima through
//        one allreduce per mesh and update, so no rank gathers the parameters (seed 000's
//        full_tensor()) and each byte crosses the network once. The sub-band holding the
//        band's first row writes its scale row.
//   families: a receiver tensor name is a family (the same fused tensor on every TP rank),
//        taken in order of first appearance, dense before expert, so the small dense weights
//        are not queued behind the experts.
//   senders: each task goes to the eligible trainer with the fewest bytes so far (ties to the
//        lower rank); a split band goes to the mesh with the fewest bytes so far (ties to the
//        first mesh).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/sharded_tensor.h"

namespace wl::transfer {

// Source rows [row_begin, row_end) of a parameter whose mesh rank k holds rows shard_of(k)
// (of `mesh_size` ranks), landing at receiver row `dst_row`: fn(mesh_rank, begin, end, dst) for
// every non-empty piece, in mesh-rank order.
template <typename ShardOf, typename Fn>
void cut_at_shards(int mesh_size, ShardOf&& shard_of, int64_t row_begin, int64_t row_end,
                   int64_t dst_row, Fn&& fn) {
  for (int k = 0; k < mesh_size; ++k) {
    const ShardRows sh = shard_of(k);
    const int64_t b = std::max(row_begin, sh.begin), e = std::min(row_end, sh.end);
    if (b < e) fn(k, b, e, dst_row + b - row_begin);
  }
}

// The fp8 bands of a tensor of `rows` rows: fn(r0, r1) for [0, 128), [128, 256), ...
template <typename Fn>
void for_each_band(int64_t rows, Fn&& fn) {
  for (int64_t r0 = 0; r0 < rows; r0 += kFp8BlockSize) fn(r0, std::min(rows, r0 + kFp8BlockSize));
}

// The parameter rows [*b, *e) that band [r0, r1) reads from a source whose rows
// [row_begin, row_begin + rows) land at receiver rows from dst_row; *dst is where the first of
// them lands. False if the band does not overlap the source.
inline bool band_piece(int64_t row_begin, int64_t rows, int64_t dst_row, int64_t r0, int64_t r1,
                       int64_t* b, int64_t* e, int64_t* dst) {
  const int64_t lo = std::max(dst_row, r0), hi = std::min(dst_row + rows, r1);
  if (lo >= hi) return false;
  *b = row_begin + lo - dst_row;
  *e = row_begin + hi - dst_row;
  *dst = lo;
  return true;
}

// The lowest mesh rank whose shards hold every piece a band reads, or -1: it is split.
// `pieces`: a range of elements with b and e (parameter rows [b, e)); shard_of(piece, k): the
// rows mesh rank k (of `mesh_size`) holds of the piece's parameter.
template <typename Pieces, typename ShardOf>
int direct_mesh_rank(int mesh_size, const Pieces& pieces, ShardOf&& shard_of) {
  for (int k = 0; k < mesh_size; ++k) {
    bool all = true;
    for (const auto& p : pieces) all = all && shard_of(p, k).contains(p.b, p.e);
    if (all) return k;
  }
  return -1;
}

// One cut of a band that no mesh rank holds whole: parameter rows [b, e) of the band's piece
// `piece`, held by mesh rank `k`, landing at receiver row `dst`.
struct BandCut {
  size_t piece = 0;
  int k = 0;
  int64_t b = 0, e = 0, dst = 0;
};

// The sub-bands of such a band: its pieces (a range of elements with b, e and dst: parameter
// rows [b, e) landing at receiver row dst) cut at the shards, in receiver-row order, and
// grouped into runs that one mesh rank holds and that land on consecutive rows.
// fn(k, cuts) for each run; `cuts` is scratch, reused between bands.
template <typename Pieces, typename ShardOf, typename Fn>
void split_band(int mesh_size, const Pieces& pieces, ShardOf&& shard_of, std::vector<BandCut>& cuts,
                Fn&& fn) {
  cuts.clear();
  size_t i = 0;
  for (const auto& p : pieces) {
    cut_at_shards(
        mesh_size, [&](int k) { return shard_of(p, k); }, p.b, p.e, p.dst,
        [&](int k, int64_t b, int64_t e, int64_t dst) {
          cuts.push_back({i, k, b, e, dst});
        });
    ++i;
  }
  std::stable_sort(cuts.begin(), cuts.end(),
                   [](const BandCut& x, const BandCut& y) { return x.dst < y.dst; });
  for (size_t first = 0; first < cuts.size();) {
    size_t last = first + 1;
    while (last < cuts.size() && cuts[last].k == cuts[first].k &&
           cuts[last].dst == cuts[last - 1].dst + cuts[last - 1].e - cuts[last - 1].b) {
      ++last;
    }
    fn(cuts[first].k, std::span<const BandCut>(cuts.data() + first, last - first));
    first = last;
  }
}

// The families rule's order: `families`, gathered in order of first appearance over the
// receivers, reordered dense before expert, each group keeping that order. is_expert(f): whether
// family f is an expert tensor. (Both callers gather families their own way: the planner by
// name from each receiver, the schedule once per layout.)
template <typename T, typename IsExpert>
void dense_before_expert(std::vector<T>& families, IsExpert&& is_expert) {
  std::stable_partition(families.begin(), families.end(),
                        [&](const T& f) { return !is_expert(f); });
}

// The sender rule: `rank` with `load` bytes so far beats `best` (with `best_load`; -1: none).
inline bool fewer_bytes(int rank, uint64_t load, int best, uint64_t best_load) {
  return best < 0 || load < best_load || (load == best_load && rank < best);
}

}  // namespace wl::transfer
