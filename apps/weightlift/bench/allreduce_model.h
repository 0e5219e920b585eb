// `weightlift bench collectives --model`: the allreduce cost model of docs/algorithms.md
// ("Choosing the allreduce algorithm") evaluated for many ranks across hosts, where no
// machine at hand can measure it.
//
//   print_allreduce_model({.model = {.alpha = 5e-6, .beta = 1 / 12.5e9}});
//
// For each world size (8, 16, .. 1024 ranks, or those asked for) it prints the predicted time of
// the ring, the double binary tree, the bidirectional ring and recursive doubling at sizes 8 B, 64
// B, .. 1 GiB (x8), marking the cheapest; then one line per world size with the size from which the
// ring is faster than the tree and the selector's choice over the whole range.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "weightlift/comm/collectives/allreduce.h"

namespace wl::app {

struct AllreduceModelOptions {
  comm::AllreduceCostModel model;
  std::vector<int> ranks = {8, 16, 32, 64, 128, 256, 512, 1024};
  size_t min_bytes = 8;                // first row of each table
  size_t max_bytes = size_t(1) << 30;  // last row of each table
  int factor = 8;                      // size multiplier between rows
  // One JSON object per row instead of the tables: {"ranks", "bytes", "<algorithm>_us" for
  // each, "choice"}, then one per world size: {"ranks", "ring_beats_tree_from" (bytes; 0:
  // always, null: not below 1 TiB)}.
  bool json = false;
  std::FILE* out = stdout;
};

void print_allreduce_model(const AllreduceModelOptions& options);

// The smallest size (bytes, on a grid of 16 steps per doubling up to 1 TiB) from which the
// ring's predicted time stays at or below the tree's; 0 if the tree is never faster, SIZE_MAX
// if the ring never catches up on the grid.
size_t ring_tree_crossover(int ranks, const comm::AllreduceCostModel& model);

// "8 B", "4 KiB", "1.5 MiB": sizes for people.
std::string human_bytes(double bytes);

}  // namespace wl::app
