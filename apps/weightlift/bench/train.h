// `weightlift bench train`: the time of one training step (forward, backward, AdamW) on
// random tokens, its throughput, and the achieved GFLOP/s against oneDNN's GEMM peak measured
// in the same run.
#pragma once

#include <cstdint>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/model/precision.h"

namespace wl::app {

struct BenchTrainOptions {
  std::string preset = "small";
  int64_t batch = 8;
  int64_t seq = 256;
  model::Precision precision = model::Precision::kF32;
  bool checkpointing = false;
  int64_t warmup_steps = 2;  // not timed: first-touch allocation, primitive creation
  int64_t steps = 5;         // timed
};

struct BenchTrainResult {
  double step_ms_median = 0, step_ms_min = 0, step_ms_max = 0;
  double tokens_per_s = 0;
  double gflops = 0;            // model FLOPs (model_info.h) / median step time
  double gemm_peak_gflops = 0;  // oneDNN f32 GEMM 2048^3, same run
  int threads = 0;
  std::string to_json(const BenchTrainOptions& o) const;
};

Result<BenchTrainResult> bench_train(const BenchTrainOptions& options);

// Median GFLOP/s of an f32 GEMM of size n^3 through kernels::gemm.
double measure_gemm_gflops(int64_t n, int repeats);

}  // namespace wl::app
