#include "bench/allreduce_model.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace wl::app {

using comm::AllreduceAlgorithm;

namespace {

constexpr AllreduceAlgorithm kModelled[] = {AllreduceAlgorithm::kRing, AllreduceAlgorithm::kTree,
                                            AllreduceAlgorithm::kBidirectionalRing,
                                            AllreduceAlgorithm::kRecursiveDoubling};

// Sizes 8 B .. 1 TiB, 16 per doubling: fine enough that a crossover is placed within 5%.
std::vector<size_t> fine_grid() {
  std::vector<size_t> sizes;
  for (int k = 3 * 16; k <= 40 * 16; ++k) {
    const auto n = size_t(std::llround(std::exp2(double(k) / 16.0)));
    if (sizes.empty() || n != sizes.back()) sizes.push_back(n);
  }
  return sizes;
}

}  // namespace

std::string human_bytes(double n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (n >= 1024.0 && u < 4) {
    n /= 1024.0;
    ++u;
  }
  char buf[32];
  if (n == std::floor(n))
    std::snprintf(buf, sizeof buf, "%.0f %s", n, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", n, units[u]);
  return buf;
}

size_t ring_tree_crossover(int P, const comm::AllreduceCostModel& m) {
  const std::vector<size_t> grid = fine_grid();
  // Scan down from the top: the crossover is just above the largest size where the tree
  // still wins.
  for (size_t i = grid.size(); i-- > 0;) {
    const double ring = allreduce_cost_seconds(AllreduceAlgorithm::kRing, grid[i], P, m);
    const double tree = allreduce_cost_seconds(AllreduceAlgorithm::kTree, grid[i], P, m);
    if (tree < ring) {
      return i + 1 < grid.size() ? grid[i + 1] : std::numeric_limits<size_t>::max();
    }
  }
  return 0;
}

namespace {

void print_allreduce_model_json(const AllreduceModelOptions& o) {
  const comm::AllreduceCostModel& m = o.model;
  for (int P : o.ranks) {
    for (size_t n = o.min_bytes; n <= o.max_bytes;) {
      std::fprintf(o.out, "{\"ranks\":%d,\"bytes\":%zu", P, n);
      for (AllreduceAlgorithm a : kModelled) {
        std::fprintf(o.out, ",\"%s_us\":%.3f",
                     std::string(comm::allreduce_algorithm_name(a)).c_str(),
                     allreduce_cost_seconds(a, n, P, m) * 1e6);
      }
      const AllreduceAlgorithm pick = comm::choose_allreduce_algorithm(n, P, m);
      std::fprintf(o.out, ",\"choice\":\"%s\"}\n",
                   std::string(comm::allreduce_algorithm_name(pick)).c_str());
      if (n > o.max_bytes / size_t(o.factor)) break;
      n *= size_t(o.factor);
    }
  }
  for (int P : o.ranks) {
    const size_t x = ring_tree_crossover(P, m);
    if (x == std::numeric_limits<size_t>::max()) {
      std::fprintf(o.out, "{\"ranks\":%d,\"ring_beats_tree_from\":null}\n", P);
    } else {
      std::fprintf(o.out, "{\"ranks\":%d,\"ring_beats_tree_from\":%zu}\n", P, x);
    }
  }
  std::fflush(o.out);
}

}  // namespace

void print_allreduce_model(const AllreduceModelOptions& o) {
  if (o.json) return print_allreduce_model_json(o);
  const comm::AllreduceCostModel& m = o.model;
  const double stream = m.stream_beta > m.beta ? m.stream_beta : m.beta;
  std::fprintf(o.out,
               "# allreduce cost model (docs/algorithms.md): alpha %.2f us, link %.2f GB/s, one "
               "stream %.2f GB/s, reduce %.2f GB/s, tree segment %s\n",
               m.alpha * 1e6, 1e-9 / m.beta, 1e-9 / stream, 1e-9 / m.gamma,
               human_bytes(double(m.segment_bytes != 0 ? m.segment_bytes : 256 << 10)).c_str());
  std::fprintf(o.out, "# predicted time (us); * marks the cheapest, which kAuto picks\n");
  std::fprintf(o.out, "# %6s %10s %12s %12s %12s %12s\n", "ranks", "size", "ring", "tree",
               "bidir_ring", "rec_doubling");
  for (int P : o.ranks) {
    for (size_t n = o.min_bytes; n <= o.max_bytes;) {
      const AllreduceAlgorithm pick = comm::choose_allreduce_algorithm(n, P, m);
      std::fprintf(o.out, "  %6d %10s", P, human_bytes(double(n)).c_str());
      for (AllreduceAlgorithm a : kModelled) {
        const double us = allreduce_cost_seconds(a, n, P, m) * 1e6;
        std::fprintf(o.out, " %11.1f%c", us, a == pick ? '*' : ' ');
      }
      std::fprintf(o.out, "\n");
      if (n > o.max_bytes / size_t(o.factor)) break;
      n *= size_t(o.factor);
    }
  }
  std::fprintf(o.out, "#\n# %6s %18s  %s\n", "ranks", "ring beats tree", "kAuto's choice by size");
  const std::vector<size_t> grid = fine_grid();
  for (int P : o.ranks) {
    const size_t x = ring_tree_crossover(P, m);
    const std::string cross = x == 0 ? "always"
                              : x == std::numeric_limits<size_t>::max()
                                  ? "never (< 1 TiB)"
                                  : "from " + human_bytes(double(x));
    // Runs of one choice over the grid: "rec_doubling < 64 KiB <= tree < 8 MiB <= ring".
    std::string runs;
    AllreduceAlgorithm last = AllreduceAlgorithm::kAuto;
    for (size_t n : grid) {
      if (n > (size_t(1) << 30)) break;
      const AllreduceAlgorithm a = comm::choose_allreduce_algorithm(n, P, m);
      if (a == last) continue;
      if (!runs.empty()) runs += " < " + human_bytes(double(n)) + " <= ";
      runs += std::string(comm::allreduce_algorithm_name(a));
      last = a;
    }
    std::fprintf(o.out, "  %6d %18s  %s (8 B .. 1 GiB)\n", P, cross.c_str(), runs.c_str());
  }
  std::fflush(o.out);
}

}  // namespace wl::app
