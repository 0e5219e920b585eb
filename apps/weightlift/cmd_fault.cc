// `weightlift fault simulate`: CheckFree's experiment with every pipeline stage in one process
// (fault/simulate.h): stages lost on a seeded schedule, brought back by the chosen strategy.
// Writes summary.json (every loss and its recovery, the validation curve) and val_loss.svg.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "fault_flags.h"
#include "report/progress.h"
#include "report/svg_plot.h"
#include "validate.h"
#include "weightlift/core/file_io.h"
#include "weightlift/fault/simulate.h"
#include "weightlift/train/brown.h"
#include "weightlift/train/run.h"
#include "weightlift/train/tokenizer.h"

namespace wl::app {
namespace {

struct FaultArgs {
  fault::SimulationOptions o;
  std::string preset = "tiny";
  std::string config_path;
  std::string recovery = "checkfree";
  std::string corpus_dir = "data/brown";
  std::string out_dir = "runs/fault";
  std::vector<std::string> kills;  // "ITERATION:STAGE"
  bool overwrite = false;
  bool quiet = false;
};

nlohmann::json json_number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nullptr; }

nlohmann::json loss_to_json(const fault::LossRecord& l) {
  nlohmann::json stages = nlohmann::json::array();
  for (const fault::Rebuild& b : l.plan) {
    nlohmann::json e = {{"stage", b.stage}, {"how", fault::rebuild_kind_name(b.kind)}};
    if (b.kind == fault::Rebuild::Kind::kAverage) e["from"] = {b.left, b.right};
    if (b.kind == fault::Rebuild::Kind::kCopy) e["from"] = {b.left};
    stages.push_back(e);
  }
  nlohmann::json j = {{"iteration", l.iteration},
                      {"stages", stages},
                      {"loss_before", json_number(l.loss_before)},
                      {"loss_after", l.loss_after},
                      {"recovery_ms", l.recovery_ms}};
  if (l.rolled_back_to >= 0) j["rolled_back_to"] = l.rolled_back_to;
  return j;
}

// The flags into the simulation's options, refused before any work.
Status make_options(FaultArgs& a) {
  fault::SimulationOptions& o = a.o;
  WL_ASSIGN_OR_RETURN(o.recovery, fault::parse_recovery(a.recovery));
  WL_ASSIGN_OR_RETURN(o.scheduled, parse_kills(a.kills));
  if (!a.config_path.empty()) {
    WL_ASSIGN_OR_RETURN(o.config, model::load_config(a.config_path));
  } else {
    WL_ASSIGN_OR_RETURN(o.config, model::preset(a.preset));
  }
  if (o.config.vocab_size < train::kByteVocab) {
    return invalid_argument("the byte tokenizer needs vocab_size >= " +
                            std::to_string(train::kByteVocab));
  }
  return fault::check_simulation(o);
}

// summary.json: the run's settings, every stage loss and the validation curve.
nlohmann::json summary_json(const FaultArgs& a, const fault::SimulationResult& r) {
  const fault::SimulationOptions& o = a.o;
  nlohmann::json curve = nlohmann::json::array();
  for (const fault::IterationRecord& e : r.evaluations) {
    curve.push_back({{"iteration", e.iteration},
                     {"progress", e.progress},
                     {"val_loss", e.val_loss},
                     {"losses", e.losses},
                     {"seconds", e.seconds}});
  }
  nlohmann::json losses = nlohmann::json::array();
  for (const fault::LossRecord& l : r.losses) losses.push_back(loss_to_json(l));
  return {{"model", a.config_path.empty() ? a.preset : a.config_path},
          {"stages", o.stages},
          {"recovery", a.recovery},
          {"swap", o.swap || o.recovery == fault::Recovery::kCheckFreePlus},
          {"fail_prob", o.fail_prob},
          {"fail_seed", o.fail_seed},
          {"checkpoint_every", o.checkpoint_every},
          {"lr", o.schedule.base_lr},
          {"lr_scale", o.lr_scale},
          {"batch", o.batch},
          {"seq", o.seq},
          {"micro_batches", o.micro_batches},
          {"seed", o.seed},
          {"iterations", r.iterations},
          {"progress", r.progress},
          {"final_val_loss", r.final_val_loss},
          {"seconds", r.seconds},
          {"step_seconds", r.step_seconds},
          {"checkpoints", r.checkpoints},
          {"checkpoint_write_ms", r.checkpoint_write_ms},
          {"losses", losses},
          {"evaluations", curve}};
}

Status write_outputs(const FaultArgs& a, const fault::SimulationResult& r) {
  WL_RETURN_IF_ERROR(
      write_file_atomically(a.out_dir + "/summary.json", summary_json(a, r).dump(1) + "\n"));
  Series series{.label = a.recovery, .color = "#1f77b4", .x = {}, .y = {}};
  for (const fault::IterationRecord& e : r.evaluations) {
    series.x.push_back(double(e.iteration));
    series.y.push_back(e.val_loss);
  }
  return write_svg_plot(a.out_dir + "/val_loss.svg", {series},
                        {.title = "weightlift fault simulate: validation loss, " + a.recovery,
                         .x_label = "iteration (wall-clock)",
                         .y_label = "validation loss (nats per byte)"});
}

Status run_fault_simulate(FaultArgs a) {
  fault::SimulationOptions& o = a.o;
  WL_RETURN_IF_ERROR(make_options(a));
  // Refuse before any work: a directory that holds another run's results stays as it was.
  const std::string summary_path = a.out_dir + "/summary.json";
  const auto check_no_results = [&]() -> Status {
    if (!a.overwrite && std::filesystem::exists(summary_path)) {
      return failed_precondition(summary_path + " holds another run's results; pass --overwrite");
    }
    return check_output_path(summary_path);
  };
  WL_RETURN_IF_ERROR(check_no_results());
  WL_ASSIGN_OR_RETURN(train::BrownCorpus corpus, train::load_brown(a.corpus_dir));
  const std::vector<int64_t> train_tokens = train::encode(corpus.train);
  const std::vector<int64_t> val_tokens = train::encode(corpus.validation);
  o.train_tokens = &train_tokens;
  o.val_tokens = &val_tokens;
  // One run at a time in --out: a second one started beside this one is refused now, not
  // left to replace this one's results when both finish.
  WL_ASSIGN_OR_RETURN(const DirectoryLock lock, train::hold_out_dir(a.out_dir, "--out"));
  WL_RETURN_IF_ERROR(check_no_results());  // again, now that no other run can write there

  ProgressBar bar("fault " + a.recovery, o.iterations, "it");
  int64_t recoveries = 0;
  double val = NAN;
  if (!a.quiet) {
    o.on_iteration = [&](const fault::IterationRecord& r) {
      if (std::isfinite(r.val_loss)) val = r.val_loss;
      char status[96];
      std::snprintf(status, sizeof status, "loss %.3f  val %.3f  step %lld  recoveries %lld",
                    r.loss, val, (long long)r.progress, (long long)recoveries);
      bar.update(r.iteration, double(r.iteration) / std::max(r.seconds, 1e-9), "it/s", status);
    };
    o.on_loss = [&](const fault::LossRecord&) { ++recoveries; };
  }
  WL_ASSIGN_OR_RETURN(const fault::SimulationResult r, fault::simulate(o));
  if (!a.quiet) bar.finish();
  WL_RETURN_IF_ERROR(write_outputs(a, r));
  if (!a.quiet) {
    std::printf(
        "fault: %s, %lld iterations, %zu stage losses, model at step %lld, "
        "validation loss %.4f; %.1f ms per step\nwrote %s/{summary.json,val_loss.svg}\n",
        a.recovery.c_str(), (long long)r.iterations, r.losses.size(), (long long)r.progress,
        r.final_val_loss, r.step_seconds * 1e3, a.out_dir.c_str());
  }
  return ok_status();
}

}  // namespace

void register_fault(CLI::App& app, Outcome& out) {
  auto* fault_cmd = app.add_subcommand("fault", "training that survives a lost pipeline stage");
  fault_cmd->require_subcommand(1);
  auto* cmd = fault_cmd->add_subcommand(
      "simulate",
      "CheckFree's experiment: every pipeline stage in one process, stages lost on "
      "a seeded schedule and recovered");
  auto a = std::make_shared<FaultArgs>();
  fault::SimulationOptions& o = a->o;
  cmd->add_option("--preset", a->preset, "model preset")->capture_default_str();
  cmd->add_option("--config", a->config_path, "a config.json instead of a preset");
  a->corpus_dir = default_corpus_dir();
  cmd->add_option("--corpus", a->corpus_dir, "Brown corpus directory")->capture_default_str();
  cmd->add_option("--stages", o.stages, "pipeline stages (they divide the layers)")
      ->capture_default_str()
      ->transform(count(1, 1024));
  cmd->add_option("--recovery", a->recovery, "none, checkpoint, checkfree or checkfree+")
      ->capture_default_str();
  cmd->add_flag("--swap", o.swap,
                "run the swapped schedule on odd micro-batches (checkfree+ always does)");
  cmd->add_option("--fail-prob", o.fail_prob, "probability each stage is lost at each iteration")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1}));
  cmd->add_option("--fail-seed", o.fail_seed, "the failure schedule (the same for every strategy)")
      ->capture_default_str()
      ->transform(u64());
  cmd->add_option("--kill", a->kills, "also lose STAGE at ITERATION (ITERATION:STAGE, repeatable)");
  cmd->add_option("--checkpoint-every", o.checkpoint_every,
                  "checkpoint recovery: iterations between checkpoints")
      ->capture_default_str()
      ->transform(count(1, kMaxSteps));
  cmd->add_option("--lr", o.schedule.base_lr, "learning rate (constant, as the paper's)")
      ->capture_default_str()
      ->transform(real(kPositive));
  cmd->add_option("--lr-scale", o.lr_scale, "a rebuilt stage's learning-rate factor")
      ->capture_default_str()
      ->transform(real(kPositive));
  cmd->add_option("--iterations", o.iterations, "iterations (wall-clock) to run")
      ->capture_default_str()
      ->transform(count(1, kMaxSteps));
  cmd->add_option("--batch", o.batch, "rows per iteration")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--seq", o.seq, "tokens per row")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--micro-batches", o.micro_batches, "micro-batches per iteration")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--eval-every", o.eval_every, "iterations between validation passes")
      ->capture_default_str()
      ->transform(count(0, kMaxSteps));
  cmd->add_option("--eval-windows", o.eval_windows, "validation windows")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--seed", o.seed, "weights and data order")
      ->capture_default_str()
      ->transform(u64());
  cmd->add_option("--out", a->out_dir, "output directory")->capture_default_str();
  cmd->add_flag("--overwrite", a->overwrite, "replace another run's results in --out");
  cmd->add_flag("--quiet", a->quiet, "no progress bar or summary line");
  cmd->callback([&out, a] {
    // The constant learning rate of the paper's LLaMa runs: no warmup, no decay.
    a->o.schedule.min_lr = a->o.schedule.base_lr;
    a->o.schedule.warmup_steps = 0;
    out.exit_code = report("fault simulate", run_fault_simulate(*a));
  });
}

}  // namespace wl::app
