// Timing for reports and benchmarks: a stopwatch on the steady clock, and the percentiles every
// report quotes (p50 and p99, as nccl-tests' successors do; the median is p50).
#pragma once

#include <chrono>
#include <vector>

namespace wl {

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const {  // since construction or the last restart()
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void restart() { start_ = std::chrono::steady_clock::now(); }

 private:
  std::chrono::steady_clock::time_point start_;
};

// The q-quantile (0 <= q <= 1) of `samples` by the nearest-rank method: the smallest sample
// with at least q of them at or below it. NaN for no samples.
double percentile(std::vector<double> samples, double q);

}  // namespace wl
