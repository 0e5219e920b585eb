#include <cstdio>

#include "bench/generate.h"
#include "bench/train.h"
#include "commands.h"
#include "validate.h"
#include "weightlift/core/cpu.h"

namespace wl::app {

namespace {

// What bench train's command line names in words, and whether it prints JSON.
struct BenchTrainFlags {
  std::string precision = "f32";
  std::string dp_mode = "ddp";
  std::string schedule = "auto";
  bool json = false;
};

void add_bench_train_flags(CLI::App* cmd, BenchTrainOptions& o, BenchTrainFlags& f) {
  cmd->add_option("--preset", o.preset)->capture_default_str();
  cmd->add_option("--model-dir", o.model_dir,
                  "a Hugging Face checkpoint directory: its shapes instead of the preset's");
  cmd->add_option("--batch", o.batch)->capture_default_str()->transform(count(1, kMaxRows));
  cmd->add_option("--seq", o.seq)->capture_default_str()->transform(count(1, kMaxRows));
  cmd->add_option("--precision,--dtype", f.precision, "f32, bf16 or f16 GEMM operands")
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "timed steps")
      ->capture_default_str()
      ->transform(count(1, 1000000));
  cmd->add_option("--warmup", o.warmup_steps, "untimed steps first")
      ->capture_default_str()
      ->transform(count(0, 1000000));
  cmd->add_flag("--checkpointing", o.checkpointing);
  cmd->add_option("--capacity-factor", o.capacity_factor,
                  "token dropping at this capacity factor (replaces the config's)")
      ->transform(real(kPositive));
  cmd->add_option("--dp-mode", f.dp_mode, "under a launcher: ddp, zero1, zero2 or fsdp")
      ->capture_default_str();
  cmd->add_option("--micro-batches", o.layout.micro_batches)
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--pp", o.layout.pp, "pipeline stages")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--pp-schedule", f.schedule, parallel::kScheduleFlagHelp)->capture_default_str();
  cmd->add_option("--ep", o.layout.ep, "expert-parallel group size")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--tp", o.layout.tp, "tensor-parallel group size")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--bucket-bytes", o.layout.bucket_bytes)
      ->capture_default_str()
      ->transform(bytes(1, kTiB));
  cmd->add_option("--timeout", o.timeout_s, "seconds any collective may wait")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = double(kMaxSeconds), .lo_open = true}));
  cmd->add_flag("--json", f.json, "print one JSON object");
}

// The words of the command line as the enums the benchmark takes.
Status resolve_names(const BenchTrainFlags& f, BenchTrainOptions& o) {
  WL_ASSIGN_OR_RETURN(o.layout.dp_mode, parallel::parse_dp_mode_flag(f.dp_mode));
  WL_ASSIGN_OR_RETURN(o.layout.schedule,
                      parallel::parse_schedule_flag(f.schedule, o.layout.dp_mode));
  auto p = model::precision_from_name(f.precision);
  if (!p) return invalid_argument("--precision '" + f.precision + "': expected f32, bf16 or f16");
  o.precision = *p;
  return ok_status();
}

Status run_bench_train(BenchTrainOptions o, const BenchTrainFlags& f) {
  WL_RETURN_IF_ERROR(resolve_names(f, o));
  WL_ASSIGN_OR_RETURN(const BenchTrainResult r, bench_train(o));
  if (!r.report) return ok_status();  // rank 0 speaks for the job
  if (f.json) {
    std::printf("%s\n", r.to_json(o).c_str());
  } else {
    char drop[96] = "";
    if (r.capacity_factor) {
      std::snprintf(drop, sizeof drop, "; capacity factor %g drops %.2f%% of routing slots",
                    *r.capacity_factor, 100 * r.drop_rate);
    }
    std::printf(
        "bench train %s batch %ld x %ld %s, %d ranks (%s) x %d threads on %s: step %.1f ms "
        "p50 (min %.1f, p99 %.1f, max %.1f), %.0f tokens/s, %.1f GFLOP/s = %.0f%% of the %.1f "
        "GFLOP/s %s GEMM peak measured now; exposed communication %.1f ms, peak %.1f MB "
        "of model state per rank%s\n",
        (o.model_dir.empty() ? o.preset : o.model_dir).c_str(), long(o.batch), long(o.seq),
        f.precision.c_str(), r.ranks,
        (std::string(parallel::dp_mode_name(o.layout.dp_mode)) +
         (o.layout.pp > 1 ? ", pp " + std::to_string(o.layout.pp) : "") +
         (o.layout.ep > 1 ? ", ep " + std::to_string(o.layout.ep) : "") +
         (o.layout.tp > 1 ? ", tp " + std::to_string(o.layout.tp) : ""))
            .c_str(),
        r.threads, cpu_info().describe().c_str(), r.step_ms_median, r.step_ms_min, r.step_ms_p99,
        r.step_ms_max, r.tokens_per_s, r.gflops, 100 * r.gflops / r.gemm_peak_gflops,
        r.gemm_peak_gflops, std::string(dtype_name(model::gemm_operand_type(o.precision))).c_str(),
        r.exposed_comm_ms, double(r.peak_bytes_per_rank) / 1e6, drop);
  }
  return ok_status();
}

void register_bench_train(CLI::App& bench, Outcome& out) {
  auto* cmd = bench.add_subcommand("train", "time a training step");
  auto o = std::make_shared<BenchTrainOptions>();
  auto f = std::make_shared<BenchTrainFlags>();
  add_bench_train_flags(cmd, *o, *f);
  cmd->callback([&out, o, f] { out.exit_code = report("bench train", run_bench_train(*o, *f)); });
}

struct BenchGenerateFlags {
  std::string dtype = "bf16";
  bool json = false;
};

Status run_bench_generate(BenchGenerateOptions o, const BenchGenerateFlags& f) {
  WL_ASSIGN_OR_RETURN(
      o.format, parse_choice<transfer::WeightFormat>("--dtype", f.dtype,
                                                     {{"bf16", transfer::WeightFormat::kBF16},
                                                      {"fp8", transfer::WeightFormat::kFP8}}));
  WL_ASSIGN_OR_RETURN(const BenchGenerateResult r, bench_generate(o));
  if (f.json) {
    std::printf("%s\n", r.to_json(o).c_str());
    return ok_status();
  }
  const double rows = double(o.prompts * o.group);
  const double bound = r.decode_rows / (r.decode_step_bound_ms / 1e3);
  std::printf(
      "bench generate %s %s, %ld prompts x %ld = %.0f rows, %ld prompt + %ld new tokens, %d "
      "threads on %s: %.0f tokens/s; prefill %.1f ms (bound %.1f ms: %.0f%%; every row "
      "prefilled: %.1f ms), decode %.0f "
      "tokens/s (bound %.0f: %.0f%%; a step reads %.1f MB of weights at %.1f GB/s, f32 GEMM "
      "peak %.1f GFLOP/s, both measured now)\n",
      o.preset.c_str(), f.dtype.c_str(), long(o.prompts), long(o.group), rows,
      long(o.prompt_tokens), long(o.new_tokens), r.threads, cpu_info().describe().c_str(),
      r.tokens_per_s, r.prefill_ms, r.prefill_bound_ms, 100 * r.prefill_bound_ms / r.prefill_ms,
      r.prefill_every_row_ms, r.decode_tokens_per_s, bound, 100 * r.decode_tokens_per_s / bound,
      r.weight_bytes / 1e6, r.copy_gbps, r.gemm_peak_gflops);
  std::printf(
      "  KV cache in pages of %ld tokens: %.1f MB held at most, the worker's pool %.1f MB\n",
      long(o.kv_page_tokens), r.kv_bytes / 1e6, r.kv_pool_bytes / 1e6);
  if (o.slots > 0) {
    std::printf(
        "  over %ld slots: %.0f tokens/s, %.2fx every row at once, its KV cache %.1f MB against "
        "%.1f MB\n",
        long(o.slots), r.slots_tokens_per_s, r.slots_speedup, r.slots_kv_bytes / 1e6,
        r.kv_bytes / 1e6);
  }
  return ok_status();
}

void register_bench_generate(CLI::App& bench, Outcome& out) {
  auto* cmd = bench.add_subcommand(
      "generate",
      "time the rollout engine's generation of a GRPO batch, against this machine's bounds");
  auto o = std::make_shared<BenchGenerateOptions>();
  auto f = std::make_shared<BenchGenerateFlags>();
  cmd->add_option("--preset", o->preset)->capture_default_str();
  cmd->add_option("--prompts", o->prompts, "distinct prompts (groups)")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--group", o->group, "rows of each prompt (G)")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--prompt-tokens", o->prompt_tokens)
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--new-tokens", o->new_tokens)
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--dtype", f->dtype, "what the engine holds: bf16 or fp8")->capture_default_str();
  cmd->add_option("--runs", o->runs, "timed runs, after one untimed")
      ->capture_default_str()
      ->transform(count(1, 1000));
  cmd->add_option("--seed", o->seed)->capture_default_str();
  cmd->add_flag("--bf16-activations", o->bf16_activations,
                "bf16 weights multiplied as stored against bf16-rounded activations, where the "
                "CPU has bf16 GEMMs");
  cmd->add_flag("--varied-lengths", o->varied_lengths,
                "each row stops after a number of new tokens drawn in [1, --new-tokens]");
  cmd->add_option("--slots", o->slots,
                  "also generate over this many slots (continuous batching), in turn with "
                  "every row at once")
      ->capture_default_str()
      ->transform(count(0, kMaxRows));
  cmd->add_flag("--widen-per-generation", o->widen_per_generation,
                "every weight matrix widened to f32 once per generation, not a band per step");
  cmd->add_option("--kv-page-tokens", o->kv_page_tokens, "positions per page of the KV cache")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_flag("--json", f->json, "one JSON object");
  cmd->callback(
      [&out, o, f] { out.exit_code = report("bench generate", run_bench_generate(*o, *f)); });
}

}  // namespace

void register_bench(CLI::App& app, Outcome& out) {
  auto* bench = app.add_subcommand("bench", "benchmarks (not tests): times and same-run ratios");
  bench->require_subcommand(1);
  register_bench_collectives(*bench, out);
  register_bench_transfer(*bench, out);
  register_bench_puts(*bench, out);
  register_bench_train(*bench, out);
  register_bench_generate(*bench, out);
}

}  // namespace wl::app
