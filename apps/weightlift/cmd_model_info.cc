#include <cstdio>

#include "commands.h"
#include "report/model_info.h"
#include "validate.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/parallel/layout/layout.h"

namespace wl::app {

namespace {

struct ModelInfoFlags {
  std::string preset = "small";
  std::string config;
  std::string model_dir;  // a Hugging Face checkpoint's config.json, as our model
  int dp = 1, pp = 1, ep = 1, tp = 1;
  std::string dp_mode = "ddp";
  bool per_rank = false;  // any of --dp, --pp, --ep, --tp, --dp-mode: print the per-rank table
  // Activations: printed when --batch is given.
  int64_t batch = 0, seq = 0;
  int micro_batches = 1;
  std::string schedule = "auto";
  bool checkpointing = false;
};

Status run_model_info(const ModelInfoFlags& f) {
  model::ModelConfig cfg;
  if (!f.model_dir.empty()) {
    WL_ASSIGN_OR_RETURN(const model::HfCheckpoint hf, model::open_hf_checkpoint(f.model_dir));
    cfg = hf.config;
  } else {
    WL_ASSIGN_OR_RETURN(cfg,
                        f.config.empty() ? model::preset(f.preset) : model::load_config(f.config));
  }
  WL_ASSIGN_OR_RETURN(const parallel::DpMode mode, parallel::parse_dp_mode_flag(f.dp_mode));
  if (f.pp > cfg.num_layers) {
    return invalid_argument("--pp " + std::to_string(f.pp) + ": the model has only " +
                            std::to_string(cfg.num_layers) + " layers to cut into stages");
  }
  const std::string name = !f.model_dir.empty() ? f.model_dir
                           : f.config.empty()   ? f.preset
                                                : f.config;
  WL_ASSIGN_OR_RETURN(const parallel::PipelineSchedule schedule,
                      parallel::parse_schedule_flag(f.schedule, mode));
  if (f.per_rank || f.batch > 0) {
    const parallel::ParallelLayout layout{.dp_mode = mode,
                                          .dp = f.dp,
                                          .pp = f.pp,
                                          .tp = f.tp,
                                          .ep = f.ep,
                                          .schedule = schedule,
                                          .micro_batches = f.micro_batches};
    WL_RETURN_IF_ERROR(parallel::check_expert_parallel(layout, cfg));
    WL_RETURN_IF_ERROR(parallel::check_tensor_parallel(layout, cfg));
    // Checked before anything is printed, so an error is the command's only output.
    std::string acts;
    if (f.batch > 0) {
      WL_ASSIGN_OR_RETURN(
          acts, per_rank_activation_report(cfg, layout, f.batch,
                                           f.seq > 0 ? f.seq : cfg.max_seq_len, f.checkpointing));
    }
    WL_ASSIGN_OR_RETURN(std::string table, per_rank_state_report(cfg, layout));
    std::fputs(model_info_report(name, model::model_info(cfg)).c_str(), stdout);
    std::fputs(table.c_str(), stdout);
    if (acts.empty()) {
      std::puts("    Activations: give --batch (the global batch) and --seq, --micro-batches,");
      std::puts("    --pp-schedule, --checkpointing as for train to see each rank's.");
    }
    std::fputs(acts.c_str(), stdout);
  } else {
    std::fputs(model_info_report(name, model::model_info(cfg)).c_str(), stdout);
  }
  if (name == "seed-6.9b") {
    std::puts(
        "  note: seed 003 calls this model \"6.9B total, 0.7B active\"; its own shapes give "
        "the active count above (4 of 16 experts of ffn 6144 in each of 30 layers).");
  }
  return ok_status();
}

}  // namespace

void register_model_info(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand("model-info", "parameter counts and memory of a model");
  auto f = std::make_shared<ModelInfoFlags>();
  cmd->add_option("--preset", f->preset, "tiny, small, medium or seed-6.9b");
  auto* config = cmd->add_option("--config", f->config, "a config.json instead of a preset");
  cmd->add_option("--model-dir", f->model_dir, "a Hugging Face checkpoint instead of a preset")
      ->excludes(config);
  auto* dp =
      cmd->add_option("--dp", f->dp, "data-parallel ranks per stage: print what each rank holds")
          ->transform(count(1, kMaxSimulatedGpus));
  auto* pp = cmd->add_option("--pp", f->pp, "pipeline stages: print what each rank holds")
                 ->transform(count(1, kMaxSimulatedGpus));
  auto* ep = cmd->add_option("--ep", f->ep,
                             "expert-parallel size (divides --dp and the experts): print what "
                             "each rank holds")
                 ->transform(count(1, kMaxSimulatedGpus));
  auto* tp = cmd->add_option("--tp", f->tp,
                             "tensor-parallel size (divides the heads and ffn rows): print what "
                             "each rank holds")
                 ->transform(count(1, kMaxSimulatedGpus));
  auto* mode = cmd->add_option("--dp-mode", f->dp_mode,
                               "ddp, zero1, zero2 or fsdp: print what each rank holds");
  cmd->add_option("--batch", f->batch, "global batch rows: also print each rank's activations")
      ->transform(count(1, kMaxRows));
  cmd->add_option("--seq", f->seq, "tokens per row (0 = max_seq_len)")
      ->transform(count(0, kMaxRows));
  cmd->add_option("--micro-batches", f->micro_batches, "micro-batches per global batch")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--pp-schedule", f->schedule, parallel::kScheduleFlagHelp)->capture_default_str();
  cmd->add_flag("--checkpointing", f->checkpointing, "gradient checkpointing");
  cmd->callback([&out, f, dp, pp, ep, tp, mode] {
    f->per_rank = dp->count() + pp->count() + ep->count() + tp->count() + mode->count() > 0;
    out.exit_code = report("model-info", run_model_info(*f));
  });
}

}  // namespace wl::app
