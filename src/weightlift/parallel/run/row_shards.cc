// row_shards.h.
#include "weightlift/parallel/run/row_shards.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "weightlift/comm/collectives/allgather.h"

namespace wl::parallel {
namespace {

int64_t width_of(const model::ParamInfo& p) { return p.numel() / std::max<int64_t>(p.shape[0], 1); }

}  // namespace

RowShards::RowShards(DataParallel& dp, std::shared_ptr<comm::Group> world,
                     std::chrono::milliseconds timeout)
    : dp_(dp),
      world_(std::move(world)),
      timeout_(timeout),
      rank_(world_ ? world_->rank() : 0),
      ranks_(world_ ? world_->size() : 1) {}

Result<std::unique_ptr<RowShards>> RowShards::create(DataParallel& dp,
                                                     std::shared_ptr<comm::Group> world,
                                                     std::chrono::milliseconds timeout) {
  std::unique_ptr<RowShards> s(new RowShards(dp, std::move(world), timeout));
  // Every rank's own weight rows, as five integers each: parameter, rows, columns.
  const model::ParamLayout& layout = dp.layout();
  std::vector<int64_t> mine;
  for (const StateRows& r : dp.own_rows()) {
    if (r.kind != StateKind::kWeights) continue;
    const model::ParamInfo& p = layout.params()[r.param];
    mine.insert(mine.end(), {int64_t(r.param), r.rows.begin, r.rows.end, r.cols ? r.cols->begin : 0,
                             r.cols ? r.cols->end : width_of(p)});
  }
  std::vector<size_t> counts(size_t(s->ranks_), mine.size());
  std::vector<int64_t> all = mine;
  if (s->world_) {
    std::vector<int64_t> sizes(counts.size());
    const int64_t n = int64_t(mine.size());
    WL_RETURN_IF_ERROR(comm::allgather(
        *s->world_,
        {.send = &n, .recv = sizes.data(), .count = 1, .dtype = DType::kI64, .timeout = timeout}));
    size_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) total += counts[r] = size_t(sizes[r]);
    all.assign(total, 0);
    WL_RETURN_IF_ERROR(comm::allgatherv(*s->world_, {.send = mine.data(),
                                                     .recv = all.data(),
                                                     .counts = counts,
                                                     .dtype = DType::kI64,
                                                     .timeout = timeout}));
  }
  std::vector<std::vector<Band>> owned(counts.size());
  size_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    for (size_t i = 0; i < counts[r]; i += 5, at += 5) {
      owned[r].push_back({all[at], all[at + 1], all[at + 2], all[at + 3], all[at + 4]});
    }
  }
  s->mine_ = owned[size_t(s->rank_)];
  const Status planned = s->plan(owned);
  if (!s->world_) {
    WL_RETURN_IF_ERROR(planned);
    return s;
  }
  // Each rank checks its own shards' coverage: they fail together, not one of them at
  // create() and the others at their first refresh's timeout.
  const int64_t failed = planned.ok() ? 0 : 1;
  std::vector<int64_t> each(size_t(s->ranks_), 0);
  WL_RETURN_IF_ERROR(comm::allgather(*s->world_, {.send = &failed,
                                                  .recv = each.data(),
                                                  .count = 1,
                                                  .dtype = DType::kI64,
                                                  .timeout = timeout}));
  WL_RETURN_IF_ERROR(planned);
  for (size_t r = 0; r < each.size(); ++r) {
    if (each[r] != 0) {
      return internal_error("rank " + std::to_string(r) +
                            ": the layout's own rows do not cover its shards exactly (its error "
                            "names the parameter)");
    }
  }
  return s;
}

void RowShards::choose_splits(const std::vector<std::vector<Band>>& owned) {
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  // Per parameter, each rank's one band of it (null: none), and whether any rank owns a band
  // of columns or more than one band.
  std::vector<std::vector<const Band*>> band_of(params.size(),
                                                std::vector<const Band*>(size_t(ranks_)));
  std::vector<bool> rows_only(params.size(), true);
  for (int r = 0; r < ranks_; ++r) {
    for (const Band& b : owned[size_t(r)]) {
      if (b.param < 0 || size_t(b.param) >= params.size()) continue;  // plan() refuses it
      const Band*& slot = band_of[size_t(b.param)][size_t(r)];
      if (slot != nullptr || b.c0 != 0 || b.c1 != width_of(params[size_t(b.param)])) {
        rows_only[size_t(b.param)] = false;
      }
      slot = &b;
    }
  }
  splits_.clear();
  for (size_t p = 0; p < params.size(); ++p) {
    const int64_t rows = params[p].shape[0];
    if (rows_only[p]) {
      std::vector<ShardRows> per_rank;
      int64_t at = 0;
      for (const Band* b : band_of[p]) {
        per_rank.push_back(b != nullptr ? ShardRows{b->r0, b->r1} : ShardRows{at, at});
        at = per_rank.back().end;
      }
      if (Result<RowSplit> split = RowSplit::of(per_rank, rows, params[p].name); split.ok()) {
        splits_.push_back(*std::move(split));
        continue;
      }
    }
    splits_.push_back(RowSplit::even(rows, ranks_));
  }
}

// Whether each rank owns exactly its shard of every parameter, every column of it.
bool RowShards::owned_as_shards(const std::vector<std::vector<Band>>& owned) const {
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  for (int r = 0; r < ranks_; ++r) {
    std::vector<Band> expect, got = owned[size_t(r)];
    for (size_t p = 0; p < params.size(); ++p) {
      const ShardRows rows = splits_[p].rank_rows(r);
      if (rows.size() > 0) {
        expect.push_back({int64_t(p), rows.begin, rows.end, 0, width_of(params[p])});
      }
    }
    std::sort(got.begin(), got.end(),
              [](const Band& a, const Band& b) { return a.param < b.param; });
    const bool same = std::equal(
        expect.begin(), expect.end(), got.begin(), got.end(), [](const Band& a, const Band& b) {
          return a.param == b.param && a.r0 == b.r0 && a.r1 == b.r1 && a.c0 == b.c0 && a.c1 == b.c1;
        });
    if (!same) return false;
  }
  return true;
}

Status RowShards::plan(const std::vector<std::vector<Band>>& owned) {
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  choose_splits(owned);
  auto shard_of = [&](int64_t param, int rank) { return splits_[size_t(param)].rank_rows(rank); };
  // This rank's shards, back to back in ParamLayout order.
  shard_offset_.assign(params.size(), -1);
  for (size_t p = 0; p < params.size(); ++p) {
    const ShardRows rows = shard_of(int64_t(p), rank_);
    if (rows.size() == 0) continue;
    shard_offset_[p] = shard_elems_;
    shard_elems_ += rows.size() * width_of(params[p]);
  }
  in_place_ = owned_as_shards(owned);
  // Each band of an owner's piece that falls in a rank's shard, in the owner's piece order:
  // the order both ends pack and unpack in.
  sends_.assign(size_t(ranks_), {});
  recvs_.assign(size_t(ranks_), {});
  std::vector<uint8_t> covered(size_t(shard_elems_), 0);
  for (int src = 0; src < ranks_; ++src) {
    const std::vector<Band>& pieces = owned[size_t(src)];
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Band& piece = pieces[i];
      if (piece.param < 0 || size_t(piece.param) >= params.size()) {
        return internal_error("rank " + std::to_string(src) + " owns parameter " +
                              std::to_string(piece.param) + " of " + std::to_string(params.size()));
      }
      for (int dst = 0; dst < ranks_; ++dst) {
        const ShardRows s = shard_of(piece.param, dst);
        Band band = piece;
        band.r0 = std::max(piece.r0, s.begin);
        band.r1 = std::min(piece.r1, s.end);
        if (band.r1 <= band.r0 || band.c1 <= band.c0) continue;
        if (src == rank_) {
          sends_[size_t(dst)].push_back({band, i});
          if (dst != rank_) sent_elems_ += band.elems();
        }
        if (dst != rank_) continue;
        recvs_[size_t(src)].push_back(band);
        const int64_t width = width_of(params[size_t(band.param)]);
        for (int64_t row = band.r0; row < band.r1; ++row) {
          const int64_t first =
              shard_offset_[size_t(band.param)] + (row - s.begin) * width + band.c0;
          for (int64_t e = first; e < first + (band.c1 - band.c0); ++e) {
            if (covered[size_t(e)]++ != 0) {
              return internal_error(params[size_t(band.param)].name + " row " +
                                    std::to_string(row) + ": owned by more than one rank");
            }
          }
        }
      }
    }
  }
  place_bands();
  for (size_t p = 0; p < params.size(); ++p) {
    if (shard_offset_[p] < 0) continue;
    const ShardRows rows = shard_of(int64_t(p), rank_);
    const auto first = covered.begin() + shard_offset_[p];
    const auto gap = std::find(first, first + rows.size() * width_of(params[p]), uint8_t(0));
    if (gap != first + rows.size() * width_of(params[p])) {
      return internal_error(params[p].name + " row " +
                            std::to_string(rows.begin + (gap - first) / width_of(params[p])) +
                            ": owned by no rank");
    }
  }
  return ok_status();
}

void RowShards::place_bands() {
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  // A shard that is one whole-width band of one of this rank's own pieces is read where it
  // lies; count each parameter's bands to find them.
  std::vector<int> bands(params.size(), 0);
  direct_.assign(params.size(), -1);
  for (int src = 0; src < ranks_; ++src) {
    for (const Band& b : recvs_[size_t(src)]) ++bands[size_t(b.param)];
  }
  for (const Move& m : sends_[size_t(rank_)]) {
    const Band& b = m.band;
    if (bands[size_t(b.param)] == 1 && b.c0 == 0 && b.c1 == width_of(params[size_t(b.param)])) {
      direct_[size_t(b.param)] = int64_t(m.piece);
    }
  }
  // A whole-width band from another rank is a run of its shard's rows: received in place. A
  // band of columns is received into staging and copied row by row.
  stage_at_.assign(size_t(ranks_), {});
  staged_elems_ = 0;
  for (int src = 0; src < ranks_; ++src) {
    for (const Band& b : recvs_[size_t(src)]) {
      const bool whole = b.c0 == 0 && b.c1 == width_of(params[size_t(b.param)]);
      stage_at_[size_t(src)].push_back(whole || src == rank_ ? -1 : staged_elems_);
      if (!whole && src != rank_) staged_elems_ += b.elems();
    }
  }
}

Result<std::vector<const float*>> RowShards::pieces_now() {
  std::vector<const float*> data;
  for (const StateRows& r : dp_.own_rows()) {
    if (r.kind != StateKind::kWeights) continue;
    const size_t i = data.size();
    if (i >= mine_.size() || size_t(mine_[i].param) != r.param || mine_[i].r0 != r.rows.begin ||
        mine_[i].r1 != r.rows.end) {
      return internal_error("rank " + std::to_string(rank_) +
                            "'s own rows changed since they were planned (piece " +
                            std::to_string(i) + ")");
    }
    data.push_back(r.data);
  }
  if (data.size() != mine_.size()) {
    return internal_error("rank " + std::to_string(rank_) + " owns " + std::to_string(data.size()) +
                          " pieces now, " + std::to_string(mine_.size()) + " when planned");
  }
  return data;
}

void RowShards::unpack(const Band& band, const float* from) {
  const model::ParamInfo& p = dp_.layout().params()[size_t(band.param)];
  const int64_t width = width_of(p), cols = band.c1 - band.c0;
  float* shard = shards_.data() + shard_offset_[size_t(band.param)];
  const int64_t first = splits_[size_t(band.param)].rank_rows(rank_).begin;
  for (int64_t row = band.r0; row < band.r1; ++row, from += cols) {
    std::memcpy(shard + (row - first) * width + band.c0, from, size_t(cols) * sizeof(float));
  }
}

Result<std::vector<RowShards::Shard>> RowShards::refresh() {
  WL_ASSIGN_OR_RETURN(const std::vector<const float*> pieces, pieces_now());
  std::vector<Shard> out;
  if (in_place_) {
    for (size_t i = 0; i < mine_.size(); ++i) {
      out.push_back({size_t(mine_[i].param), {mine_[i].r0, mine_[i].r1}, pieces[i]});
    }
    std::sort(out.begin(), out.end(),
              [](const Shard& a, const Shard& b) { return a.param < b.param; });
    return out;
  }
  shards_.resize(size_t(shard_elems_));
  stage_.resize(size_t(staged_elems_));
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  auto in_shard = [&](const Band& b) {
    const model::ParamInfo& p = params[size_t(b.param)];
    const int64_t first = splits_[size_t(b.param)].rank_rows(rank_).begin;
    return shards_.data() + shard_offset_[size_t(b.param)] + (b.r0 - first) * width_of(p);
  };
  // A band is whole rows of its piece (every column the piece has): one run of it.
  auto in_piece = [&](const Move& m) {
    const Band& b = m.band;
    return pieces[m.piece] + (b.r0 - mine_[m.piece].r0) * (b.c1 - b.c0);
  };
  // One message per band, each way, straight from the piece and (whole width) into the
  // shard; both ends post a pair's bands in the same order, which UCX matches in order.
  std::vector<comm::Request> requests;
  const uint32_t sequence = world_ ? world_->next_sequence() : 0;
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    const std::vector<Band>& in = recvs_[size_t(r)];
    for (size_t k = 0; k < in.size(); ++k) {
      const int64_t staged = stage_at_[size_t(r)][k];
      float* to = staged < 0 ? in_shard(in[k]) : stage_.data() + staged;
      requests.push_back(world_->irecv(r, sequence, uint32_t(k), to, size_t(in[k].elems()) * 4));
    }
    const std::vector<Move>& out_to = sends_[size_t(r)];
    for (size_t k = 0; k < out_to.size(); ++k) {
      requests.push_back(world_->isend(r, sequence, uint32_t(k), in_piece(out_to[k]),
                                       size_t(out_to[k].band.elems()) * 4));
    }
  }
  for (const Move& m : sends_[size_t(rank_)]) {
    if (direct_[size_t(m.band.param)] < 0) unpack(m.band, in_piece(m));
  }
  if (!requests.empty()) {
    WL_RETURN_IF_ERROR(world_->wait_all(requests, world_->deadline(timeout_)));
  }
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    const std::vector<Band>& in = recvs_[size_t(r)];
    for (size_t k = 0; k < in.size(); ++k) {
      if (stage_at_[size_t(r)][k] >= 0) unpack(in[k], stage_.data() + stage_at_[size_t(r)][k]);
    }
  }
  for (size_t p = 0; p < params.size(); ++p) {
    if (shard_offset_[p] < 0) continue;
    const ShardRows rows = splits_[p].rank_rows(rank_);
    const int64_t piece = direct_[p];
    const float* data =
        piece >= 0
            ? pieces[size_t(piece)] + (rows.begin - mine_[size_t(piece)].r0) * width_of(params[p])
            : shards_.data() + shard_offset_[p];
    out.push_back({p, rows, data});
  }
  return out;
}

Result<std::vector<float>> RowShards::refresh_packed() {
  WL_ASSIGN_OR_RETURN(const std::vector<Shard> shards, refresh());
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  std::vector<float> out;
  out.reserve(size_t(shard_elems_));
  for (const Shard& s : shards) {
    out.insert(out.end(), s.data, s.data + s.rows.size() * width_of(params[s.param]));
  }
  WL_CHECK_EQ(int64_t(out.size()), shard_elems_) << "shards of rank " << rank_;
  return out;
}

void RowShards::place(int rank, const float* packed, float* whole) const {
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardRows r = splits_[i].rank_rows(rank);
    const int64_t width = width_of(params[i]), n = r.size() * width;
    std::copy_n(packed, n, whole + params[i].offset + r.begin * width);
    packed += n;
  }
}

int64_t RowShards::shard_elems(int rank) const {
  const std::vector<model::ParamInfo>& params = dp_.layout().params();
  int64_t n = 0;
  for (size_t i = 0; i < params.size(); ++i)
    n += splits_[i].rank_rows(rank).size() * width_of(params[i]);
  return n;
}

}  // namespace wl::parallel
