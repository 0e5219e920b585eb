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

}  // namespace wl
