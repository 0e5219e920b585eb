#include <cmath>
#include <cstdio>

#include "commands.h"
#include "report/loss_plot.h"
#include "report/progress.h"
#include "weightlift/train/trainer.h"

namespace wl::app {

namespace {

// The progress bar's status: the loss's moving average and the last validation loss.
class TrainProgress {
 public:
  explicit TrainProgress(int64_t steps) : bar_("train", steps, "steps") {}
  void operator()(const train::StepMetrics& m) {
    loss_.add(m.loss);
    if (std::isfinite(m.val_loss)) val_loss_ = m.val_loss;
    char status[64];
    int n = std::snprintf(status, sizeof status, "loss %.3f", loss_.value());
    if (std::isfinite(val_loss_)) {
      std::snprintf(status + n, sizeof status - size_t(n), "  val %.3f", val_loss_);
    }
    bar_.update(m.step, m.tokens_per_s, "tok/s", status);
  }
  void finish() { bar_.finish(); }

 private:
  ProgressBar bar_;
  Ema loss_{0.95};
  double val_loss_ = NAN;
};

void print_summary(const train::TrainOptions& o, const train::TrainSummary& r) {
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

Status run_train(train::TrainOptions o, const std::string& precision, bool quiet) {
  auto p = model::precision_from_name(precision);
  if (!p) return invalid_argument("--precision '" + precision + "': expected f32, bf16 or f16");
  o.precision = *p;
  TrainProgress progress(o.steps);
  if (!quiet) o.on_step = [&](const train::StepMetrics& m) { progress(m); };
  Result<train::TrainSummary> r = train::train(o);
  if (!quiet) progress.finish();
  WL_RETURN_IF_ERROR(r.status());
  const std::string model = o.config_path.empty() ? o.preset : o.config_path;
  WL_RETURN_IF_ERROR(write_loss_plot({.metrics_path = o.out_dir + "/metrics.jsonl",
                                      .svg_path = o.out_dir + "/loss.svg",
                                      .title = "weightlift " + model + ": loss (nats per byte)",
                                      .unigram_entropy = r->unigram_entropy}));
  if (!quiet) print_summary(o, *r);
  return ok_status();
}

}  // namespace

void register_train(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand("train", "train a model on the Brown corpus (or a fixed batch)");
  auto o = std::make_shared<train::TrainOptions>();
  auto precision = std::make_shared<std::string>("f32");
  cmd->add_option("--preset", o->preset, "tiny, small, medium or seed-6.9b")->capture_default_str();
  cmd->add_option("--config", o->config_path, "a config.json instead of a preset");
  cmd->add_option("--init-weights", o->init_weights, "start from these weights (safetensors)");
  cmd->add_option("--resume", o->resume, "continue bit-exactly from this checkpoint directory");
  cmd->add_option("--seed", o->seed, "weights init and data order")->capture_default_str();
  cmd->add_option("--corpus", o->corpus_dir, "Brown corpus directory")->capture_default_str();
  cmd->add_option("--batch-file", o->batch_file,
                  "train on this fixed batch (safetensors: int64 tokens, targets)");
  cmd->add_option("--batch", o->batch, "rows per micro-batch")->capture_default_str();
  cmd->add_option("--seq", o->seq, "tokens per row (0 = max_seq_len)")->capture_default_str();
  cmd->add_option("--grad-accum", o->grad_accum, "micro-batches per update")->capture_default_str();
  cmd->add_option("--steps", o->steps, "updates (also the schedule's length)")
      ->capture_default_str();
  cmd->add_option("--lr", o->schedule.base_lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", o->schedule.min_lr, "learning rate at the end of the cosine")
      ->capture_default_str();
  cmd->add_option("--warmup-steps", o->schedule.warmup_steps, "linear warmup updates")
      ->capture_default_str();
  cmd->add_option("--beta1", o->adamw.beta1)->capture_default_str();
  cmd->add_option("--beta2", o->adamw.beta2)->capture_default_str();
  cmd->add_option("--adam-eps", o->adamw.eps)->capture_default_str();
  cmd->add_option("--weight-decay", o->adamw.weight_decay, "decoupled, matrices only")
      ->capture_default_str();
  cmd->add_option("--grad-clip", o->adamw.grad_clip, "global norm; 0 = off")->capture_default_str();
  cmd->add_option("--precision", *precision, "f32, bf16 or f16 (dynamic loss scaling)")
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
  auto quiet = std::make_shared<bool>(false);
  cmd->add_flag("--quiet", *quiet, "no progress bar or summary");
  cmd->callback([&out, o, precision, quiet] {
    out.exit_code = report("train", run_train(*o, *precision, *quiet));
  });
}

}  // namespace wl::app
