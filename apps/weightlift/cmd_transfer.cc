#include <cstdio>

#include "commands.h"
#include "weightlift/transfer/bench_transfer.h"
#include "weightlift/transfer/plan_command.h"

namespace wl::app {

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
