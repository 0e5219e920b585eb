// shard.h.
#include "weightlift/core/shard.h"

#include <algorithm>

#include "weightlift/core/check.h"

namespace wl {

int64_t shard_capacity(int64_t rows, int ranks) {
  WL_CHECK(ranks >= 1 && rows >= 0) << "rows " << rows << " ranks " << ranks;
  return (rows + ranks - 1) / ranks;
}

ShardRows shard_rows(int64_t rows, int ranks, int rank) {
  WL_CHECK(rank >= 0 && rank < ranks) << "rank " << rank << " of " << ranks;
  const int64_t chunk = shard_capacity(rows, ranks);
  return {std::min(rows, chunk * rank), std::min(rows, chunk * (rank + 1))};
}

RowSplit RowSplit::even(int64_t rows, int ranks) {
  RowSplit s;
  s.bounds_.assign(size_t(ranks) + 1, 0);
  for (int k = 0; k < ranks; ++k) s.bounds_[size_t(k) + 1] = shard_rows(rows, ranks, k).end;
  return s;
}

Result<RowSplit> RowSplit::of(std::span<const ShardRows> per_rank, int64_t rows,
                              const std::string& what) {
  if (per_rank.empty()) return invalid_argument(what + ": rows split over no rank");
  RowSplit s;
  s.bounds_.assign(1, 0);
  for (size_t k = 0; k < per_rank.size(); ++k) {
    const ShardRows& r = per_rank[k];
    if (r.begin != s.bounds_.back() || r.end < r.begin) {
      return invalid_argument(
          what + ": rank " + std::to_string(k) + " holds rows [" + std::to_string(r.begin) + ", " +
          std::to_string(r.end) + "), the ranks before it end at row " +
          std::to_string(s.bounds_.back()) + " (each rank's rows must follow the previous rank's)");
    }
    s.bounds_.push_back(r.end);
  }
  if (s.bounds_.back() != rows) {
    return invalid_argument(what + ": the ranks hold rows [0, " + std::to_string(s.bounds_.back()) +
                            ") of " + std::to_string(rows));
  }
  return s;
}

ShardRows RowSplit::rank_rows(int rank) const {
  WL_CHECK(rank >= 0 && rank < ranks()) << "rank " << rank << " of " << ranks();
  return {bounds_[size_t(rank)], bounds_[size_t(rank) + 1]};
}

}  // namespace wl
