#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "commands.h"
#include "weightlift/transfer/bench_transfer.h"
#include "weightlift/transfer/plan_command.h"
#include "weightlift/transfer/simulate_command.h"

namespace wl::app {
namespace {

// A progress line on stderr for a terminal, once a run has taken more than two seconds.
class Progress {
 public:
  void operator()(const std::string& stage, double fraction) {
    using namespace std::chrono;
    if (!isatty(STDERR_FILENO) || steady_clock::now() - start_ < seconds(2)) return;
    std::fprintf(stderr, "\r%-40s %3d%%", stage.c_str(), int(fraction * 100));
    shown_ = true;
  }
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\r%-45s\r", "");
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool shown_ = false;
};

void register_transfer_simulate(CLI::App& transfer, Outcome& out) {
  auto* sim = transfer.add_subcommand(
      "simulate", "predict an update's time at cluster scale (docs/simulate.md)");
  auto o = std::make_shared<transfer::SimulateOptions>();
  sim->add_option("--model", o->model, "kimi-k2 or a preset")->capture_default_str();
  sim->add_option("--trainers", o->trainers, "trainer GPUs")->capture_default_str();
  sim->add_option("--receivers", o->receivers, "inference GPUs")->capture_default_str();
  sim->add_option("--gpus-per-node", o->gpus_per_node)->capture_default_str();
  sim->add_option("--instance-gpus", o->instance_gpus,
                  "GPUs per inference instance (its TP and EP degree)")
      ->capture_default_str();
  sim->add_option("--dense-mesh", o->dense_mesh, "trainer FSDP mesh of the dense weights")
      ->capture_default_str();
  sim->add_option("--expert-mesh", o->expert_mesh,
                  "trainer mesh of one expert-parallel position (0: experts as dense)")
      ->capture_default_str();
  sim->add_option("--dtype", o->dtype, "what receivers hold: fp8 or bf16")->capture_default_str();
  sim->add_option("--shard-dtype", o->shard_dtype, "what trainers hold: bf16 or f32")
      ->capture_default_str();
  sim->add_option("--nic-gbps", o->network.nic_gbps, "per-GPU NIC, Gb/s each way")
      ->capture_default_str();
  sim->add_option("--nvlink-gbps", o->network.nvlink_gbps, "per-GPU NVLink, Gb/s each way")
      ->capture_default_str();
  sim->add_option("--message-overhead-us", o->network.message_overhead_us,
                  "sender time per put, microseconds")
      ->capture_default_str();
  sim->add_option("--prepare-gbs", o->network.prepare_gbs,
                  "GB/s (bytes) of shards one GPU casts or quantizes")
      ->capture_default_str();
  sim->add_option("--barrier-ms", o->network.barrier_ms, "global barrier per mesh group")
      ->capture_default_str();
  sim->add_flag("--overlap,!--no-overlap", o->network.overlap, "pipeline the stages (seed 000)")
      ->capture_default_str();
  sim->add_flag("--sensitivity,!--no-sensitivity", o->sensitivity,
                "the halve/double table (reschedules for layout rows)")
      ->capture_default_str();
  sim->add_flag("--json", o->json, "one JSON object");
  sim->callback([&out, o] {
    Progress progress;
    transfer::SimulateOptions options = *o;
    options.progress = [&](const std::string& stage, double f) { progress(stage, f); };
    Result<std::string> r = transfer::simulate_transfer(options);
    if (!r.ok()) {
      out.exit_code = report("transfer simulate", r.status());
      return;
    }
    std::fputs(r->c_str(), stdout);
  });
}

}  // namespace

void register_transfer(CLI::App& app, Outcome& out) {
  auto* transfer = app.add_subcommand("transfer", "the weight transfer engine");
  transfer->require_subcommand(1);
  auto* plan = transfer->add_subcommand(
      "plan", "the static transfer plan for a trainer/receiver layout, with bytes per rank");
  auto o = std::make_shared<transfer::PlanCommandOptions>();
  plan->add_option("--preset", o->preset)->capture_default_str();
  plan->add_option("--trainers", o->trainers, "trainer ranks")->capture_default_str();
  plan->add_option("--mesh-size", o->mesh_size, "FSDP mesh size (0 = all trainers)")
      ->capture_default_str();
  plan->add_option("--receivers", o->receivers, "receiver ranks")->capture_default_str();
  plan->add_option("--tp", o->tp, "TP degree of each inference engine")->capture_default_str();
  plan->add_option("--dtype", o->dtype, "what receivers hold: bf16 or fp8")->capture_default_str();
  plan->add_option("--shard-dtype", o->shard_dtype, "what trainers hold: f32 or bf16")
      ->capture_default_str();
  plan->add_flag("--json", o->json, "the plan's JSON instead of the table");
  plan->callback([&out, o] {
    Result<std::string> r = transfer::describe_plan(*o);
    if (!r.ok()) {
      out.exit_code = report("transfer plan", r.status());
      return;
    }
    std::fputs(r->c_str(), stdout);
  });
  register_transfer_simulate(*transfer, out);
}

void register_bench_transfer(CLI::App& bench, Outcome& out) {
  auto* cmd = bench.add_subcommand("transfer", "time weight updates trainer -> receivers");
  auto o = std::make_shared<transfer::BenchTransferOptions>();
  cmd->add_option("--preset", o->preset)->capture_default_str();
  cmd->add_option("--trainers", o->trainers)->capture_default_str();
  cmd->add_option("--receivers", o->receivers)->capture_default_str();
  cmd->add_option("--tp", o->tp)->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "bf16 or fp8")->capture_default_str();
  cmd->add_option("--mode", o->mode, "p2p, broadcast or naive")->capture_default_str();
  cmd->add_option("--shard-dtype", o->shard_dtype, "bf16 or f32")->capture_default_str();
  cmd->add_option("--updates", o->updates, "timed updates")->capture_default_str();
  cmd->add_option("--watermark-bytes", o->watermark_bytes)->capture_default_str();
  cmd->add_option("--bucket-bytes", o->bucket_bytes)->capture_default_str();
  cmd->add_flag("--verify,!--no-verify", o->verify, "check receivers against the reference");
  cmd->add_flag("--json", o->json, "one JSON object");
  cmd->callback([&out, o] {
    Result<std::string> r = transfer::bench_transfer(*o);
    if (!r.ok()) {
      out.exit_code = report("bench transfer", r.status());
      return;
    }
    std::fputs(r->c_str(), stdout);
  });
}

}  // namespace wl::app
