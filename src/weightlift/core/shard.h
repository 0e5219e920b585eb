// How a tensor is cut into row shards over N ranks, once for every layer that asks: FSDP and
// ZeRO's parameter, gradient and optimizer shards (parallel/), distributed checkpoints, and the
// weight transfer planner reading a trainer rank's shards (transfer/).
//
// The rule is torch.chunk's on dim 0 (FSDP2's): each rank gets ceil(rows / N) rows, the last
// ranks fewer or none. A 1-D tensor [n] is n rows of one element. Rows of a row-major tensor
// are contiguous, so a rank's shard is one flat range of the tensor.
#pragma once

#include <cstdint>

namespace wl {

struct ShardRows {
  int64_t begin = 0, end = 0;  // rows [begin, end) of dim 0
  int64_t size() const { return end - begin; }
  bool contains(int64_t b, int64_t e) const { return begin <= b && e <= end; }
};

// Rank `rank`'s rows of a `rows`-row tensor sharded over `ranks` ranks.
ShardRows shard_rows(int64_t rows, int ranks, int rank);

// The most rows any rank holds: ceil(rows / ranks). Every rank's shard fits in this many.
int64_t shard_capacity(int64_t rows, int ranks);

}  // namespace wl
