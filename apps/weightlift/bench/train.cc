#include "bench/train.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/random.h"
#include "weightlift/core/timing.h"
#include "weightlift/kernels/gemm.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/model/model_info.h"
#include "weightlift/model/transformer.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/parallel/pipeline/pipeline.h"
#include "weightlift/parallel/run/job.h"
#include "weightlift/train/metrics.h"

namespace wl::app {

double measure_gemm_gflops(int64_t n, int repeats, DType in_type) {
  repeats = std::max(repeats, 1);
  const size_t elems = size_t(n * n);
  std::vector<float> a(elems, 0.5f), b(elems, 0.25f), c(elems);
  std::vector<uint16_t> a16, b16;
  if (in_type == DType::kBF16) {
    a16.resize(elems);
    b16.resize(elems);
    convert_f32_to_bf16(a.data(), a16.data(), elems);
    convert_f32_to_bf16(b.data(), b16.data(), elems);
  }
  const bool bf16 = in_type == DType::kBF16;
  std::vector<double> rates;
  for (int i = 0; i < repeats + 1; ++i) {
    const Stopwatch clock;
    kernels::gemm({.m = n,
                   .n = n,
                   .k = n,
                   .a = bf16 ? static_cast<const void*>(a16.data()) : a.data(),
                   .lda = n,
                   .b = bf16 ? static_cast<const void*>(b16.data()) : b.data(),
                   .ldb = n,
                   .c = c.data(),
                   .ldc = n,
                   .in_type = in_type});
    const double s = clock.seconds();
    if (i > 0) rates.push_back(2.0 * double(n) * double(n) * double(n) / s / 1e9);
  }
  return percentile(std::move(rates), 0.5);
}

namespace {

// The same random global batch on every rank.
train::Batch random_batch(const model::ModelConfig& cfg, int64_t batch, int64_t seq) {
  Rng rng(7);
  train::Batch global{batch, seq, std::vector<int64_t>(size_t(batch * seq)),
                      std::vector<int64_t>(size_t(batch * seq))};
  for (size_t i = 0; i < global.tokens.size(); ++i) {
    global.tokens[i] = int64_t(rng.below(uint64_t(cfg.vocab_size)));
    global.targets[i] = int64_t(rng.below(uint64_t(cfg.vocab_size)));
  }
  return global;
}

// Rank 0 speaks for the job: the largest peaks over the ranks go into r.
Status take_largest_peaks(parallel::Job& job, std::chrono::milliseconds timeout,
                          BenchTrainResult& r) {
  if (job.size() == 1) return ok_status();
  double peaks[2] = {double(r.peak_bytes_per_rank), double(r.peak_activation_bytes)};
  std::vector<double> all(2 * size_t(job.size()));
  WL_RETURN_IF_ERROR(comm::allgather(*job.ranks.group, {.send = peaks,
                                                        .recv = all.data(),
                                                        .count = sizeof peaks,
                                                        .dtype = DType::kU8,
                                                        .timeout = timeout}));
  for (int q = 0; q < job.size(); ++q) {
    r.peak_bytes_per_rank = std::max(r.peak_bytes_per_rank, int64_t(all[2 * size_t(q)]));
    r.peak_activation_bytes = std::max(r.peak_activation_bytes, int64_t(all[2 * size_t(q) + 1]));
  }
  return ok_status();
}

}  // namespace

Result<BenchTrainResult> bench_train(const BenchTrainOptions& o) {
  WL_ASSIGN_OR_RETURN(model::ModelConfig cfg,
                      model::preset_or_checkpoint_config(o.preset, o.model_dir));
  if (o.capacity_factor) cfg.capacity_factor = o.capacity_factor;
  WL_RETURN_IF_ERROR(cfg.validate());
  const std::string name = o.model_dir.empty() ? "preset " + o.preset : o.model_dir;
  if (o.seq < 1 || o.seq > cfg.max_seq_len)
    return invalid_argument("--seq " + std::to_string(o.seq) + " outside [1, " +
                            std::to_string(cfg.max_seq_len) + "] for " + name);
  if (o.batch < 1 || o.steps < 1) return invalid_argument("--batch and --steps must be >= 1");
  if (!(o.timeout_s > 0)) return invalid_argument("--timeout must be positive (seconds)");
  const auto timeout = std::chrono::milliseconds(int64_t(o.timeout_s * 1000));
  WL_ASSIGN_OR_RETURN(comm::LaunchEnv env, comm::read_launch_env());
  WL_ASSIGN_OR_RETURN(parallel::Job job, parallel::connect_job(env, timeout, o.layout.pp > 1));
  parallel::ParallelLayout layout = o.layout;
  layout.dp = job.size() / std::max(layout.pp * layout.tp, 1);
  WL_RETURN_IF_ERROR(parallel::validate(layout, job.size(), cfg, o.batch));
  WL_RETURN_IF_ERROR(model::check_training_memory(
      cfg, name, std::max<int64_t>(1, o.batch / (layout.dp * layout.micro_batches)), o.seq,
      layout.dp));
  WL_ASSIGN_OR_RETURN(std::unique_ptr<parallel::DataParallel> dpp,
                      parallel::make_data_parallel(cfg, layout, {}, timeout, job.ranks));
  parallel::DataParallel& dp = *dpp;
  {
    std::vector<float> full(size_t(dp.layout().total()));
    model::init_params(cfg, dp.layout(), 1, full.data());
    dp.set_params(full.data());
  }
  const train::Batch global = random_batch(cfg, o.batch, o.seq);
  std::vector<double> ms, exposed, bubble;
  int64_t slots = 0, dropped = 0;  // routing slots of the timed steps
  BenchTrainResult r;
  const parallel::StepSettings settings{
      .precision = o.precision, .checkpointing = o.checkpointing, .lr = 1e-4};
  for (int64_t s = 0; s < o.warmup_steps + o.steps; ++s) {
    if (s == o.warmup_steps) reset_tensor_memory_peak();
    const Stopwatch clock;
    parallel::PipelineTimes times;
    WL_ASSIGN_OR_RETURN(
        const parallel::StepResult step,
        layout.pp > 1 ? parallel::run_pipeline_step(dp, global, settings, layout.schedule, &times)
                      : parallel::run_step(dp, global, settings));
    if (s < o.warmup_steps) continue;
    slots += step.loss.slots;
    dropped += step.loss.dropped;
    ms.push_back(clock.seconds() * 1e3);
    exposed.push_back(dp.step_comm().exposed_s * 1e3);
    if (layout.pp > 1) bubble.push_back(times.waited_s / times.step_s);
    r.peak_bytes_per_rank = std::max(r.peak_bytes_per_rank, dp.step_comm().peak_state_bytes);
  }
  // What the step allocated beyond the model's state: activations, and the buffers of
  // gathered units (in this process; with ranks as processes, this rank's).
  r.peak_activation_bytes = tensor_memory_stats().peak_bytes - dp.step_comm().state_bytes;
  if (!bubble.empty()) {
    r.bubble = percentile(bubble, 0.5);
    r.bubble_theory =
        parallel::theoretical_bubble(layout.schedule, layout.pp, layout.micro_batches);
  }
  r.step_ms_median = percentile(ms, 0.5);
  r.step_ms_p99 = percentile(ms, 0.99);
  r.step_ms_min = *std::min_element(ms.begin(), ms.end());
  r.step_ms_max = *std::max_element(ms.begin(), ms.end());
  r.exposed_comm_ms = percentile(exposed, 0.5);
  r.capacity_factor = cfg.capacity_factor;
  r.drop_rate = train::drop_rate(cfg.capacity_factor, slots, dropped);
  const int64_t n = o.batch * o.seq;
  r.tokens_per_s = double(n) / (r.step_ms_median / 1e3);
  r.gflops = model::model_info(cfg).train_flops_per_token(o.seq) * double(n) /
             (r.step_ms_median / 1e3) / 1e9;
  // gflops is the whole job's, so the peak is too: this rank's GEMM peak on its threads,
  // times the ranks.
  r.gemm_peak_gflops = measure_gemm_gflops(2048, 3, gemm_operand_type(o.precision)) * job.size();
  r.threads = num_threads();
  r.ranks = job.size();
  r.report = job.rank() == 0;
  WL_RETURN_IF_ERROR(take_largest_peaks(job, timeout, r));
  return r;
}

std::string BenchTrainResult::to_json(const BenchTrainOptions& o) const {
  nlohmann::json j = {
      {"preset", o.preset},
      {"batch", o.batch},
      {"seq", o.seq},
      {"dtype", std::string(model::precision_name(o.precision))},
      {"checkpointing", o.checkpointing},
      {"threads", threads},
      {"ranks", ranks},
      {"dp_mode", std::string(parallel::dp_mode_name(o.layout.dp_mode))},
      {"micro_batches", o.layout.micro_batches},
      {"exposed_comm_ms", exposed_comm_ms},
      {"peak_bytes_per_rank", peak_bytes_per_rank},
      {"peak_activation_bytes_per_rank", peak_activation_bytes},
      {"pp", o.layout.pp},
      {"ep", o.layout.ep},
      {"tp", o.layout.tp},
      // One stage runs no schedule.
      {"pp_schedule", o.layout.pp > 1
                          ? std::string(parallel::pipeline_schedule_name(o.layout.schedule))
                          : std::string("none")},
      {"bubble", bubble},
      {"bubble_theory", bubble_theory},
      {"steps", o.steps},
      {"step_ms_median", step_ms_median},
      {"step_ms_min", step_ms_min},
      {"step_ms_max", step_ms_max},
      {"step_ms_p99", step_ms_p99},
      {"tokens_per_s", tokens_per_s},
      {"gflops", gflops},
      {"gemm_peak_gflops", gemm_peak_gflops},
      {"fraction_of_gemm_peak", gflops / gemm_peak_gflops},
      {"capacity_factor", capacity_factor ? nlohmann::json(*capacity_factor) : nullptr},
      {"drop_rate", std::isfinite(drop_rate) ? nlohmann::json(drop_rate) : nullptr},
      {"gemm_peak_dtype", std::string(dtype_name(model::gemm_operand_type(o.precision)))},
      {"cpu", cpu_info().describe()}};
  return j.dump();
}

}  // namespace wl::app
