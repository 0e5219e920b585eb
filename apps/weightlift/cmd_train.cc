#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.h"
#include "fault_flags.h"
#include "report/loss_plot.h"
#include "report/progress.h"
#include "train_flags.h"
#include "validate.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/fault/trainer.h"
#include "weightlift/parallel/layout/pipeline_schedule.h"
#include "weightlift/parallel/run/job.h"
#include "weightlift/parallel/run/trainer.h"

namespace wl::app {

namespace {

// The progress bar's status: the loss's moving average and the last validation loss.
class TrainProgress {
 public:
  explicit TrainProgress(int64_t steps) : bar_("train", steps, "steps") {}
  void operator()(const train::StepMetrics& m) {
    loss_.add(m.loss);
    if (std::isfinite(m.val_loss)) val_loss_ = m.val_loss;
    char status[96];
    int n = std::snprintf(status, sizeof status, "loss %.3f", loss_.value());
    if (std::isfinite(val_loss_)) {
      n += std::snprintf(status + n, sizeof status - size_t(n), "  val %.3f", val_loss_);
    }
    if (recoveries_ > 0) {
      std::snprintf(status + n, sizeof status - size_t(n), "  recovered %d", recoveries_);
    }
    bar_.update(m.step, m.tokens_per_s, "tok/s", status);
  }
  // A lost stage brought back (train --recovery): counted on the bar from now on.
  void recovered() { ++recoveries_; }
  void finish() { bar_.finish(); }

 private:
  ProgressBar bar_;
  Ema loss_{0.95};
  double val_loss_ = NAN;
  int recoveries_ = 0;
};

// One line per recovery, for the log and for a person watching the bar.
std::string describe_recovery(const fault::RecoveryRecord& r) {
  std::string stages;
  for (const fault::Rebuild& b : r.plan) {
    stages += (stages.empty() ? "" : ", ") + std::string("stage ") + std::to_string(b.stage) + " " +
              std::string(fault::rebuild_kind_name(b.kind));
    if (b.kind == fault::Rebuild::Kind::kAverage)
      stages += " of " + std::to_string(b.left) + " and " + std::to_string(b.right);
    if (b.kind == fault::Rebuild::Kind::kCopy) stages += " of " + std::to_string(b.left);
  }
  char line[512];
  std::snprintf(line, sizeof line, "iteration %lld: %s; continued after step %lld",
                (long long)r.iteration, stages.c_str(), (long long)r.step);
  std::string out = line;
  if (r.rolled_back_to >= 0) {
    out += ", rolled back to step " + std::to_string(r.rolled_back_to) + " (" +
           (r.checkpoint.empty() ? std::string("the run's start") : r.checkpoint) + ")";
  }
  if (!r.fallback.empty()) out += "; " + r.fallback;
  std::snprintf(line, sizeof line, "; %.0f ms from detection to the first step", r.recovery_ms);
  out += line;
  if (r.detection_ms >= 0) {
    std::snprintf(line, sizeof line, " (%.0f ms from the kill to detection)", r.detection_ms);
    out += line;
  }
  std::snprintf(line, sizeof line, "; loss %.4f before, %.4f after", r.loss_before, r.loss_after);
  return out + line;
}

void print_summary(const parallel::TrainOptions& o, const parallel::TrainSummary& r) {
  std::printf("trained %ld steps in %.1f s (%.0f tokens/s)\n", long(r.steps), r.seconds,
              r.tokens_per_s);
  std::printf("final train loss %.4f", r.final_train_loss);
  if (std::isfinite(r.final_val_loss))
    std::printf(", validation loss %.4f (perplexity %.2f)", r.final_val_loss,
                std::exp(r.final_val_loss));
  if (std::isfinite(r.unigram_entropy))
    std::printf(", unigram entropy of the corpus %.4f nats/byte", r.unigram_entropy);
  std::printf("\nwrote %s/{metrics.jsonl,loss.svg,model.safetensors,config.json}\n",
              o.out_dir.c_str());
}

struct TrainFlags {
  std::string precision = "f32";
  std::string dp_mode = "ddp";
  std::string schedule = "auto";
  const CLI::Option* schedule_flag = nullptr;
  bool print_schedule = false;
  double timeout_s = 60;
  bool quiet = false;
  // A pipeline that survives a lost stage (fault/trainer.h).
  std::string recovery;  // "" : a lost rank stops the job
  fault::ResilienceOptions resilience;
  std::vector<std::string> kills, freezes;  // ITERATION:STAGE
};

// `train --recovery`: one process per stage, through the job's store, replacements included.
Status run_train_resilient(parallel::TrainOptions o, const TrainFlags& f,
                           const comm::LaunchEnv& env) {
  fault::ResilienceOptions r = f.resilience;
  WL_ASSIGN_OR_RETURN(r.recovery, fault::parse_recovery(f.recovery));
  WL_ASSIGN_OR_RETURN(r.kills, parse_kills(f.kills));
  WL_ASSIGN_OR_RETURN(r.freezes, parse_kills(f.freezes, "--freeze"));
  if (f.schedule_flag->count() > 0 && o.layout.schedule != parallel::PipelineSchedule::kGPipe) {
    return invalid_argument(
        "--recovery runs the micro-batches in GPipe's order (CheckFree+'s swapped routes visit "
        "a stage twice, which no other order describes): leave out --pp-schedule");
  }
  o.layout.schedule = parallel::PipelineSchedule::kGPipe;
  // What the strategy cannot run on is refused before any process waits for another.
  WL_ASSIGN_OR_RETURN(const parallel::RunModel resolved, parallel::run_model(o));
  WL_RETURN_IF_ERROR(fault::check_resilient_layout(o, r, resolved.config));
  if (env.world_size != o.layout.pp) {
    return invalid_argument("--recovery runs one process per pipeline stage: start --pp " +
                            std::to_string(o.layout.pp) + " processes, not " +
                            std::to_string(env.world_size));
  }
  WL_ASSIGN_OR_RETURN(comm::World world, comm::connect_store(env, o.timeout));
  const bool quiet = f.quiet || env.rank != 0;
  TrainProgress progress(o.steps);
  fault::Hooks hooks;
  if (!quiet) {
    hooks.on_step = [&](const train::StepMetrics& m) { progress(m); };
    hooks.on_recovery = [&](const fault::RecoveryRecord& rec) {
      progress.recovered();
      std::fprintf(stderr, "%srecovered: %s\n", isatty(2) ? "\r\033[K" : "",
                   describe_recovery(rec).c_str());
    };
  }
  hooks.on_notice = [&](const std::string& what) {
    std::fprintf(stderr, "stage %d: %s\n", env.rank, what.c_str());
  };
  Result<fault::Summary> s = fault::train(o, r, world.store, env.rank, env.world_size, hooks);
  if (!quiet) progress.finish();
  // A store that rank 0 hosts stays up while the other stages still settle or report.
  comm::linger_for_clients(world, o.timeout);
  WL_RETURN_IF_ERROR(s.status());
  if (env.rank != 0) return ok_status();
  const std::string model = o.config_path.empty() ? o.preset : o.config_path;
  WL_RETURN_IF_ERROR(write_loss_plot({.metrics_path = o.out_dir + "/metrics.jsonl",
                                      .svg_path = o.out_dir + "/loss.svg",
                                      .title = "weightlift " + model + ": loss (nats per byte)",
                                      .unigram_entropy = s->train.unigram_entropy}));
  if (!quiet) {
    print_summary(o, s->train);
    std::printf("%lld iterations, stages lost and recovered %zu times by %s; %s/summary.json\n",
                (long long)s->iterations, s->recoveries.size(), f.recovery.c_str(),
                o.out_dir.c_str());
  }
  return ok_status();
}

Status run_train(parallel::TrainOptions o, const TrainFlags& f) {
  auto p = model::precision_from_name(f.precision);
  if (!p) return invalid_argument("--precision '" + f.precision + "': expected f32, bf16 or f16");
  o.precision = *p;
  WL_ASSIGN_OR_RETURN(o.layout.dp_mode, parallel::parse_dp_mode_flag(f.dp_mode));
  WL_ASSIGN_OR_RETURN(o.layout.schedule,
                      parallel::parse_schedule_flag(f.schedule, o.layout.dp_mode));
  if (o.layout.pp < 1) return invalid_argument("--pp must be at least 1");
  if (o.layout.tp < 1) return invalid_argument("--tp must be at least 1");
  if (o.schedule.min_lr > o.schedule.base_lr) {
    return invalid_argument("--min-lr " + show_number(o.schedule.min_lr) + " is above --lr " +
                            show_number(o.schedule.base_lr) +
                            ": the cosine would raise the rate as training goes on");
  }
  if (f.print_schedule) {
    std::printf(
        "%s",
        parallel::print_schedule(o.layout.schedule, o.layout.pp, o.layout.micro_batches).c_str());
    return ok_status();
  }
  if (!(f.timeout_s > 0)) return invalid_argument("--timeout must be positive (seconds)");
  o.timeout = std::chrono::milliseconds(int64_t(f.timeout_s * 1000));
  WL_ASSIGN_OR_RETURN(comm::LaunchEnv env, comm::read_launch_env());
  if (!f.recovery.empty()) return run_train_resilient(o, f, env);
  if (f.resilience.fail_prob > 0 || !f.kills.empty() || !f.freezes.empty()) {
    return invalid_argument(
        "--fail-prob, --kill and --freeze lose pipeline stages on purpose: they need "
        "--recovery to bring them back");
  }
  WL_ASSIGN_OR_RETURN(parallel::Job job, parallel::connect_job(env, o.timeout, o.layout.pp > 1));
  // The ranks are stages x data parallel x tensor parallel; a --pp or --tp that does not
  // divide them fails validate().
  o.layout.dp = std::max(1, job.size() / (o.layout.pp * o.layout.tp));
  const bool fits = o.layout.dp * o.layout.pp * o.layout.tp == job.size();
  const parallel::LayoutPlace at =
      fits ? parallel::place_in(o.layout, job.rank()) : parallel::LayoutPlace{};
  const std::string role =
      (o.layout.pp > 1 ? "pp-stage-" + std::to_string(at.stage) + "-" : "") + "dp-rank-" +
      std::to_string(at.dp_rank) +
      (o.layout.ep > 1 ? "-ep-rank-" + std::to_string(at.dp_rank % o.layout.ep) : "") +
      (o.layout.tp > 1 ? "-tp-rank-" + std::to_string(at.tp_rank) : "");
  o.on_ready = [&] { return parallel::write_processes(job, o.out_dir, role, o.timeout); };
  // Rank 0 speaks for the job.
  const bool quiet = f.quiet || job.rank() != 0;
  TrainProgress progress(o.steps);
  if (!quiet) o.on_step = [&](const train::StepMetrics& m) { progress(m); };
  Result<parallel::TrainSummary> r = parallel::train(o, job.ranks);
  if (!quiet) progress.finish();
  WL_RETURN_IF_ERROR(r.status());
  if (job.rank() != 0) return ok_status();
  const std::string model = o.config_path.empty() ? o.preset : o.config_path;
  WL_RETURN_IF_ERROR(write_loss_plot({.metrics_path = o.out_dir + "/metrics.jsonl",
                                      .svg_path = o.out_dir + "/loss.svg",
                                      .title = "weightlift " + model + ": loss (nats per byte)",
                                      .unigram_entropy = r->unigram_entropy}));
  if (!quiet) print_summary(o, *r);
  return ok_status();
}

// Where the job runs: micro-batches, --dp-mode, --pp, --ep, --tp and their options.
void add_layout_flags(CLI::App& cmd, parallel::TrainOptions& o, TrainFlags& f) {
  cmd.add_option("--micro-batches", o.layout.micro_batches,
                 "the global batch in this many micro-batches (gradient accumulation)")
      ->capture_default_str();
  cmd.add_option("--dp-mode", f.dp_mode,
                 "data parallel under a launcher: ddp, zero1, zero2 or fsdp")
      ->capture_default_str();
  cmd.add_option("--pp", o.layout.pp,
                 "pipeline stages (the ranks are stages x data parallel x tensor parallel)")
      ->capture_default_str();
  f.schedule_flag = cmd.add_option("--pp-schedule", f.schedule, parallel::kScheduleFlagHelp)
                        ->capture_default_str();
  cmd.add_option("--ep", o.layout.ep,
                 "expert parallel: groups of this many data-parallel ranks share out the "
                 "experts, each rank running and holding only its own")
      ->capture_default_str();
  cmd.add_option("--tp", o.layout.tp,
                 "tensor parallel: groups of this many consecutive ranks split every block's "
                 "heads and expert ffn rows, each rank running and holding only its slices")
      ->capture_default_str();
  cmd.add_flag("--pp-schedule-print", f.print_schedule,
               "print each stage's timeline of --pp stages and --micro-batches, and stop");
  cmd.add_option("--bucket-bytes", o.layout.bucket_bytes, "ddp/zero1 gradient bucket size")
      ->capture_default_str();
}

// A pipeline that survives a lost stage: the strategy and the failures to inject.
void add_recovery_flags(CLI::App& cmd, TrainFlags& f) {
  cmd.add_option("--recovery", f.recovery,
                 "survive a lost pipeline stage (one process per stage, under launch "
                 "--restart-failed): checkfree, checkfree+, checkpoint or none");
  cmd.add_option("--lr-scale", f.resilience.lr_scale,
                 "a rebuilt stage's learning-rate factor (checkfree, checkfree+, none)")
      ->capture_default_str();
  cmd.add_option("--fail-prob", f.resilience.fail_prob,
                 "failure drill: each stage's process kills itself (SIGKILL) at the start of "
                 "an iteration with this probability")
      ->capture_default_str();
  cmd.add_option("--fail-seed", f.resilience.fail_seed,
                 "the failure schedule's seed (the same losses for every strategy)")
      ->capture_default_str();
  cmd.add_option("--kill", f.kills,
                 "failure drill: STAGE's process kills itself at ITERATION (ITERATION:STAGE, "
                 "repeatable)");
  cmd.add_option("--freeze", f.freezes,
                 "failure drill: STAGE's process stops itself (SIGSTOP) at ITERATION, as a hung "
                 "machine does; the others declare it gone at --timeout (ITERATION:STAGE)");
  cmd.add_option("--dump-rebuilds", f.resilience.rebuild_dump,
                 "failure drill: each stage a recovery rebuilds writes the weights it was "
                 "rebuilt to here (stage-S-iteration-I.safetensors), to check the rule by");
}

}  // namespace

// What to train and on what: the model (a preset, a config, weights, a checkpoint directory or a
// run to resume) and the data (the Brown corpus, documents, examples or a fixed batch).
void add_model_and_data_flags(CLI::App* cmd, parallel::TrainOptions* o) {
  cmd->add_option("--preset", o->preset, "tiny, small, medium or seed-6.9b")->capture_default_str();
  cmd->add_option("--config", o->config_path, "a config.json instead of a preset");
  cmd->add_option("--init-weights", o->init_weights, "start from these weights (safetensors)");
  cmd->add_option("--model-dir", o->model_dir,
                  "start from a Hugging Face checkpoint directory (Mixtral, Qwen3-MoE, Qwen3, "
                  "Llama): its config and weights")
      ->excludes("--config")
      ->excludes("--init-weights");
  cmd->add_option("--resume", o->resume, "continue bit-exactly from this checkpoint directory");
  cmd->add_option("--seed", o->seed, "weights init and data order")->capture_default_str();
  cmd->add_option("--capacity-factor", o->capacity_factor,
                  "token dropping: each expert takes at most this many times its even share of "
                  "a micro-batch's routing slots, the rest pass through the residual (replaces "
                  "the config's capacity_factor; default: the config's, null = dropless)");
  o->corpus_dir = default_corpus_dir();
  cmd->add_option("--corpus", o->corpus_dir, "Brown corpus directory")->capture_default_str();
  cmd->add_option("--data", o->data_path,
                  "train on these documents instead of the Brown corpus: JSONL ({\"text\": ...} "
                  "per line) or text (documents separated by blank lines)")
      ->excludes("--corpus");
  cmd->add_option("--sft", o->sft_path,
                  "supervised fine-tuning on JSONL examples ({\"prompt\", \"completion\"} or "
                  "{\"messages\"}), the loss on the completions only")
      ->excludes("--corpus")
      ->excludes("--data");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "--data's and --sft's tokens: a Hugging Face tokenizer.json (default: "
                  "--model-dir's, else bytes)");
  cmd->add_option("--batch-file", o->batch_file,
                  "train on this fixed batch (safetensors: int64 tokens, targets)")
      ->excludes("--data")
      ->excludes("--sft");
}

void register_train(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "train", "train a model on the Brown corpus, your documents (--data) or a fixed batch");
  auto o = std::make_shared<parallel::TrainOptions>();
  auto f = std::make_shared<TrainFlags>();
  add_model_and_data_flags(cmd, o.get());
  cmd->add_option("--batch", o->batch, "rows of the global batch of one update, all ranks")
      ->capture_default_str();
  cmd->add_option("--seq", o->seq, "tokens per row (0 = max_seq_len)")->capture_default_str();
  add_layout_flags(*cmd, *o, *f);
  add_recovery_flags(*cmd, *f);
  cmd->add_option("--timeout", f->timeout_s, "seconds any collective may wait")
      ->capture_default_str();
  cmd->add_option("--die-at-step", o->die_at_step,
                  "failure drill: rank --die-rank kills itself (SIGKILL) as this update starts");
  cmd->add_option("--die-rank", o->die_rank, "the rank --die-at-step kills")->capture_default_str();
  cmd->add_option("--steps", o->steps, "updates (also the schedule's length)")
      ->capture_default_str();
  cmd->add_option("--lr", o->schedule.base_lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", o->schedule.min_lr,
                  "learning rate at the end of the cosine, at most --lr [default: --lr / 10]");
  cmd->add_option("--warmup-steps", o->schedule.warmup_steps, "linear warmup updates")
      ->capture_default_str();
  cmd->add_option("--beta1", o->adamw.beta1)->capture_default_str();
  cmd->add_option("--beta2", o->adamw.beta2)->capture_default_str();
  cmd->add_option("--adam-eps", o->adamw.eps)->capture_default_str();
  cmd->add_option("--weight-decay", o->adamw.weight_decay, "decoupled, matrices only")
      ->capture_default_str();
  cmd->add_option("--grad-clip", o->adamw.grad_clip, "global norm; 0 = off")->capture_default_str();
  cmd->add_option("--precision", f->precision, "f32, bf16 or f16 (dynamic loss scaling)")
      ->capture_default_str();
  cmd->add_flag("--checkpointing", o->checkpointing, "gradient checkpointing");
  cmd->add_option("--eval-every", o->eval_every, "updates between validation passes")
      ->capture_default_str();
  cmd->add_option("--eval-windows", o->eval_windows, "validation windows")->capture_default_str();
  cmd->add_option("--checkpoint-every", o->checkpoint_every, "updates between checkpoints")
      ->capture_default_str();
  cmd->add_option("--stop-after", o->stop_after,
                  "stop at this update (the schedule still "
                  "spans --steps); for resuming later")
      ->capture_default_str();
  cmd->add_option("--out", o->out_dir, "output directory")->capture_default_str();
  cmd->add_option("--out-weights", o->out_weights, "also write the final weights here");
  cmd->add_flag("--overwrite", o->overwrite, "replace another run's results in --out");
  cmd->add_flag("--allow-changes", o->allow_changes,
                "resume with hyperparameters other than the checkpoint's");
  cmd->add_flag("--quiet", f->quiet, "no progress bar or summary");
  add_train_flag_ranges(*cmd);
  const CLI::Option* min_lr = cmd->get_option("--min-lr");
  cmd->callback([&out, o, f, min_lr] {
    // A tenth of --lr as a person writes it: 3e-3 / 10 is 0.00030000000000000003 in binary,
    // which would print, and be recorded in checkpoints, as such.
    if (min_lr->count() == 0) {
      char tenth[32];
      std::snprintf(tenth, sizeof tenth, "%.15g", o->schedule.base_lr / 10);
      o->schedule.min_lr = std::strtod(tenth, nullptr);
    }
    out.exit_code = report("train", run_train(*o, *f));
  });
}

}  // namespace wl::app
