#include "bench/train.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <vector>

#include "weightlift/core/cpu.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/random.h"
#include "weightlift/kernels/gemm.h"
#include "weightlift/model/model_info.h"
#include "weightlift/model/transformer.h"
#include "weightlift/train/adamw.h"

namespace wl::app {

using train::AdamW;
using Clock = std::chrono::steady_clock;

double measure_gemm_gflops(int64_t n, int repeats) {
  repeats = std::max(repeats, 1);
  std::vector<float> a(size_t(n * n), 0.5f), b(size_t(n * n), 0.25f), c(size_t(n * n));
  std::vector<double> rates;
  for (int i = 0; i < repeats + 1; ++i) {
    const auto t0 = Clock::now();
    kernels::gemm({.m = n,
                   .n = n,
                   .k = n,
                   .a = a.data(),
                   .lda = n,
                   .b = b.data(),
                   .ldb = n,
                   .c = c.data(),
                   .ldc = n});
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) rates.push_back(2.0 * double(n) * double(n) * double(n) / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

Result<BenchTrainResult> bench_train(const BenchTrainOptions& o) {
  WL_ASSIGN_OR_RETURN(model::ModelConfig cfg, model::preset(o.preset));
  if (o.seq < 1 || o.seq > cfg.max_seq_len)
    return invalid_argument("--seq " + std::to_string(o.seq) + " outside [1, " +
                            std::to_string(cfg.max_seq_len) + "] for preset " + o.preset);
  if (o.batch < 1 || o.steps < 1) return invalid_argument("--batch and --steps must be >= 1");
  model::Transformer m(cfg);
  m.init(1);
  AdamW opt(m.layout(), {});
  Rng rng(7);
  const int64_t n = o.batch * o.seq;
  std::vector<int64_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    tokens[size_t(i)] = int64_t(rng.below(uint64_t(cfg.vocab_size)));
    targets[size_t(i)] = int64_t(rng.below(uint64_t(cfg.vocab_size)));
  }
  std::vector<double> ms;
  for (int64_t s = 0; s < o.warmup_steps + o.steps; ++s) {
    const auto t0 = Clock::now();
    m.zero_grads();
    m.forward_backward(tokens.data(), targets.data(), o.batch, o.seq,
                       {.precision = o.precision, .checkpointing = o.checkpointing});
    opt.step(m, 1e-4);
    if (s >= o.warmup_steps)
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  BenchTrainResult r;
  r.step_ms_median = ms[ms.size() / 2];
  r.step_ms_min = ms.front();
  r.step_ms_max = ms.back();
  r.tokens_per_s = double(n) / (r.step_ms_median / 1e3);
  r.gflops = model::model_info(cfg).train_flops_per_token(o.seq) * double(n) /
             (r.step_ms_median / 1e3) / 1e9;
  r.gemm_peak_gflops = measure_gemm_gflops(2048, 3);
  r.threads = num_threads();
  return r;
}

std::string BenchTrainResult::to_json(const BenchTrainOptions& o) const {
  nlohmann::json j = {{"preset", o.preset},
                      {"batch", o.batch},
                      {"seq", o.seq},
                      {"dtype", std::string(model::precision_name(o.precision))},
                      {"checkpointing", o.checkpointing},
                      {"threads", threads},
                      {"steps", o.steps},
                      {"step_ms_median", step_ms_median},
                      {"step_ms_min", step_ms_min},
                      {"step_ms_max", step_ms_max},
                      {"tokens_per_s", tokens_per_s},
                      {"gflops", gflops},
                      {"gemm_peak_gflops", gemm_peak_gflops},
                      {"fraction_of_gemm_peak", gflops / gemm_peak_gflops},
                      {"cpu", cpu_info().describe()}};
  return j.dump();
}

}  // namespace wl::app
