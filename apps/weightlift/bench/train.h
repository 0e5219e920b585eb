// `weightlift bench train`: the time of one training step (forward, backward, AdamW) on
// random tokens, its throughput, and the achieved GFLOP/s against oneDNN's GEMM peak measured
// in the same run. Under `weightlift launch` (or any launcher) the step runs on every rank in
// the layout given (data parallel: --dp-mode), the batch being the global one, and the
// communication the compute thread waited for (exposed) and the peak bytes of model state per
// rank are reported too.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "weightlift/core/dtype.h"
#include "weightlift/core/status.h"
#include "weightlift/model/precision.h"
#include "weightlift/parallel/layout/layout.h"

namespace wl::app {

struct BenchTrainOptions {
  std::string preset = "small";
  std::string model_dir;  // a Hugging Face checkpoint's shapes instead of the preset's
  int64_t batch = 8;      // global: every rank's rows together
  int64_t seq = 256;
  model::Precision precision = model::Precision::kF32;
  bool checkpointing = false;
  std::optional<double> capacity_factor;  // replaces the config's (token dropping)
  int64_t warmup_steps = 2;               // not timed: first-touch allocation, primitive creation
  int64_t steps = 5;                      // timed
  parallel::ParallelLayout layout;        // dp is the launcher's world size
  double timeout_s = 60;
};

struct BenchTrainResult {
  double step_ms_median = 0, step_ms_min = 0, step_ms_max = 0;
  double step_ms_p99 = 0;  // nearest rank over the timed steps: the slowest of fewer than 100
  double tokens_per_s = 0;
  double gflops = 0;  // model FLOPs (model_info.h) / median step time
  // oneDNN GEMM 2048^3 in the step's operand type (model::gemm_operand_type), same run: rank 0's x
  // ranks.
  double gemm_peak_gflops = 0;
  int threads = 0;
  int ranks = 1;
  double exposed_comm_ms = 0;             // median over the timed steps
  int64_t peak_bytes_per_rank = 0;        // parameters, gradients, AdamW state, gathered units
  int64_t peak_activation_bytes = 0;      // the rest of the tensors a step holds at its peak
  double bubble = 0, bubble_theory = 0;   // pipelines: share of the step a stage waits
  std::optional<double> capacity_factor;  // the model's (the flag's, else its config's)
  double drop_rate = NAN;                 // routing slots dropped over capacity; NaN: dropless
  bool report = true;                     // this rank speaks for the job (rank 0)
  std::string to_json(const BenchTrainOptions& o) const;
};

Result<BenchTrainResult> bench_train(const BenchTrainOptions& options);

// Median GFLOP/s of a GEMM of size n^3 through kernels::gemm with operands of `in_type` (f32,
// or bf16: oneDNN's bf16 kernels where the CPU has them, else widened to f32).
double measure_gemm_gflops(int64_t n, int repeats, DType in_type = DType::kF32);

}  // namespace wl::app
