// How a tensor is cut into row shards over N ranks, once for every layer that asks: FSDP and
// ZeRO's parameter, gradient and optimizer shards (parallel/), distributed checkpoints, and the
// weight transfer planner reading a trainer rank's shards (transfer/).
//
// The rule is torch.chunk's on dim 0 (FSDP2's): each rank gets ceil(rows / N) rows, the last
// ranks fewer or none. A 1-D tensor [n] is n rows of one element. Rows of a row-major tensor
// are contiguous, so a rank's shard is one flat range of the tensor.
//
// RowSplit generalises the rule: any cut of dim 0 into one range per rank in rank order. A
// layout whose ranks own whole parameters or whole experts (pipeline stages, expert-parallel
// ranks) publishes weights cut where its ranks hold them (parallel/run/row_shards.h), and the
// transfer reads each rank's rows where they lie.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl {

struct ShardRows {
  int64_t begin = 0, end = 0;  // rows [begin, end) of dim 0
  int64_t size() const { return end - begin; }
  bool operator==(const ShardRows&) const = default;
  bool contains(int64_t b, int64_t e) const { return begin <= b && e <= end; }
};

// Rank `rank`'s rows of a `rows`-row tensor sharded over `ranks` ranks.
ShardRows shard_rows(int64_t rows, int ranks, int rank);

// The most rows any rank holds: ceil(rows / ranks). Every rank's shard fits in this many.
int64_t shard_capacity(int64_t rows, int ranks);

// A tensor's dim 0 cut into consecutive ranges of rows, one per rank in rank order: rank k's
// rows follow rank k - 1's, and a rank may hold none.
class RowSplit {
 public:
  RowSplit() = default;  // 0 rows over 1 rank
  // shard_rows()'s split.
  static RowSplit even(int64_t rows, int ranks);
  // The split where rank k holds per_rank[k]; InvalidArgument (naming `what`) unless those
  // ranges are consecutive from row 0 to row `rows`.
  static Result<RowSplit> of(std::span<const ShardRows> per_rank, int64_t rows,
                             const std::string& what);

  int ranks() const { return int(bounds_.size()) - 1; }
  int64_t rows() const { return bounds_.back(); }
  ShardRows rank_rows(int rank) const;
  bool operator==(const RowSplit&) const = default;

 private:
  std::vector<int64_t> bounds_{0, 0};  // rank k holds [bounds_[k], bounds_[k + 1])
};

}  // namespace wl
