// `weightlift transfer plan|simulate` and `weightlift bench transfer`.
#include <cstdio>
#include <optional>
#include <string>

#include "bench/transfer.h"
#include "commands.h"
#include "flag_terms.h"
#include "report/progress.h"
#include "report/transfer_plan.h"
#include "report/transfer_simulate.h"
#include "validate.h"
#include "weightlift/model/config.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/transfer/modes/update_executor.h"
#include "weightlift/transfer/plan/offline_metadata.h"

namespace wl::app {
namespace {

Result<transfer::WeightFormat> parse_format(const std::string& text) {
  return parse_choice<transfer::WeightFormat>(
      "--dtype", text,
      {{"bf16", transfer::WeightFormat::kBF16}, {"fp8", transfer::WeightFormat::kFP8}});
}

Result<DType> parse_shard_dtype(const std::string& text) {
  return parse_choice<DType>("--shard-dtype", text, {{"bf16", DType::kBF16}, {"f32", DType::kF32}});
}

// The library's names (modes/update_executor.h), so the flag accepts what fleet records carry.
Result<transfer::TransferMode> parse_mode(const std::string& text) {
  if (std::optional<transfer::TransferMode> m = transfer::transfer_mode_from_name(text)) return *m;
  std::string accepted;
  for (transfer::TransferMode m : {transfer::TransferMode::kP2P, transfer::TransferMode::kBroadcast,
                                   transfer::TransferMode::kNaive}) {
    accepted += (accepted.empty() ? "" : ", ") + std::string(transfer::transfer_mode_name(m));
  }
  return invalid_argument("--mode '" + text + "': expected one of " + accepted);
}

// The flags of `transfer simulate` as strings, until the callback turns them into enums.
struct SimulateArgs {
  transfer::ClusterOptions cluster;
  std::string dtype = "fp8", shard_dtype = "bf16";
  bool json = false;
};

Status run_transfer_simulate(SimulateArgs a) {
  WL_ASSIGN_OR_RETURN(a.cluster.format, parse_format(a.dtype));
  WL_ASSIGN_OR_RETURN(a.cluster.shard_dtype, parse_shard_dtype(a.shard_dtype));
  StageProgress progress;
  a.cluster.progress = [&](const std::string& stage, double f) {
    progress.update(in_flag_terms(stage), f);
  };
  WL_ASSIGN_OR_RETURN(transfer::Simulation s, transfer::simulate_cluster(a.cluster));
  progress.clear();
  const std::string text = a.json ? simulation_json(a.cluster, s) : simulation_report(a.cluster, s);
  std::fputs(text.c_str(), stdout);
  return ok_status();
}

void register_transfer_simulate(CLI::App& transfer, Outcome& out) {
  auto* sim = transfer.add_subcommand(
      "simulate", "predict an update's time at cluster scale (docs/simulate.md)");
  auto a = std::make_shared<SimulateArgs>();
  transfer::ClusterOptions& o = a->cluster;
  sim->add_option("--model", o.model, "kimi-k2 or a preset")->capture_default_str();
  sim->add_option("--trainers", o.trainers, "trainer GPUs")
      ->capture_default_str()
      ->transform(count(1, kMaxSimulatedGpus));
  sim->add_option("--receivers", o.receivers, "inference GPUs")
      ->capture_default_str()
      ->transform(count(1, kMaxSimulatedGpus));
  sim->add_option("--gpus-per-node", o.gpus_per_node)
      ->capture_default_str()
      ->transform(count(1, 1024));
  sim->add_option("--engine-gpus", o.engine_gpus,
                  "GPUs per inference engine (its TP and EP degree)")
      ->capture_default_str()
      ->transform(count(1, kMaxSimulatedGpus));
  sim->add_option("--dense-mesh", o.dense_mesh, "trainer FSDP mesh of the dense weights")
      ->capture_default_str()
      ->transform(count(1, kMaxSimulatedGpus));
  sim->add_option("--expert-mesh", o.expert_mesh,
                  "trainer mesh of one expert-parallel position (0: experts as dense)")
      ->capture_default_str()
      ->transform(count(0, kMaxSimulatedGpus));
  sim->add_option("--dtype", a->dtype, "what receivers hold: fp8 or bf16")->capture_default_str();
  sim->add_option("--shard-dtype", a->shard_dtype, "what trainers hold: bf16 or f32")
      ->capture_default_str();
  sim->add_option("--nic-gbps", o.network.nic_gbps, "per-GPU NIC, Gb/s each way")
      ->capture_default_str()
      ->transform(real(kPositive));
  sim->add_option("--gpus-per-nic", o.network.gpus_per_nic,
                  "GPUs of a node that share one NIC (1: a NIC each; a testbed host's ranks "
                  "share its one)")
      ->capture_default_str()
      ->transform(count(1, 1024));
  sim->add_option("--nvlink-gbps", o.network.nvlink_gbps, "per-GPU NVLink, Gb/s each way")
      ->capture_default_str()
      ->transform(real(kPositive));
  sim->add_option("--message-overhead-us", o.network.message_overhead_us,
                  "sender time per put, microseconds")
      ->capture_default_str()
      ->transform(real(kNonNegative));
  sim->add_option("--prepare-gbs", o.network.prepare_gbs,
                  "GB/s (bytes) of shards one GPU casts or quantizes")
      ->capture_default_str()
      ->transform(real(kPositive));
  sim->add_option("--barrier-ms", o.network.barrier_ms, "global barrier per mesh group")
      ->capture_default_str()
      ->transform(real(kNonNegative));
  sim->add_option("--maxima-ms", o.network.maxima_ms,
                  "a mesh's allreduce of the block maxima of its split bands (0: not modelled)")
      ->capture_default_str()
      ->transform(real(kNonNegative));
  sim->add_flag("--overlap,!--no-overlap", o.network.overlap, "pipeline the stages (seed 000)")
      ->capture_default_str();
  sim->add_flag("--sensitivity,!--no-sensitivity", o.sensitivity,
                "the halve/double table (reschedules for layout rows)")
      ->capture_default_str();
  sim->add_flag("--json", a->json, "one JSON object");
  sim->callback(
      [&out, a] { out.exit_code = report("transfer simulate", run_transfer_simulate(*a)); });
}

struct PlanArgs {
  transfer::OfflineJob job;
  std::string preset = "medium", model_dir, dtype = "bf16", shard_dtype = "f32";
  bool json = false;
};

Status run_plan(PlanArgs a) {
  WL_ASSIGN_OR_RETURN(a.job.config, model::preset_or_checkpoint_config(a.preset, a.model_dir));
  WL_ASSIGN_OR_RETURN(a.job.format, parse_format(a.dtype));
  WL_ASSIGN_OR_RETURN(a.job.shard_dtype, parse_shard_dtype(a.shard_dtype));
  WL_ASSIGN_OR_RETURN(transfer::Plan plan, transfer::plan_offline(a.job));
  const std::string text = a.json ? transfer::plan_to_json(plan) : plan_table(plan);
  std::fputs(text.c_str(), stdout);
  return ok_status();
}

void register_transfer_plan(CLI::App& transfer, Outcome& out) {
  auto* plan = transfer.add_subcommand(
      "plan", "the static transfer plan for a trainer/receiver layout, with bytes per rank");
  auto a = std::make_shared<PlanArgs>();
  plan->add_option("--preset", a->preset)->capture_default_str();
  plan->add_option("--model-dir", a->model_dir,
                   "a Hugging Face checkpoint directory: its shapes instead of the preset's");
  plan->add_option("--trainers", a->job.trainers, "trainer ranks")
      ->capture_default_str()
      ->transform(count(1, kMaxSimulatedGpus));
  plan->add_option("--mesh-size", a->job.mesh_size, "FSDP mesh size (0 = all trainers)")
      ->capture_default_str()
      ->transform(count(0, kMaxSimulatedGpus));
  plan->add_option("--receivers", a->job.receivers, "receiver ranks")
      ->capture_default_str()
      ->transform(count(1, kMaxSimulatedGpus));
  plan->add_option("--tp", a->job.tp, "TP degree of each inference engine")
      ->capture_default_str()
      ->transform(count(1, 1024));
  plan->add_option("--ep", a->job.ep,
                   "EP degree of each engine: each of its ranks holds one run of the experts")
      ->capture_default_str()
      ->transform(count(1, 1024));
  plan->add_option("--dtype", a->dtype, "what receivers hold: bf16 or fp8")->capture_default_str();
  plan->add_option("--shard-dtype", a->shard_dtype, "what trainers hold: f32 or bf16")
      ->capture_default_str();
  plan->add_flag("--json", a->json, "the plan's JSON instead of the table");
  plan->callback([&out, a] { out.exit_code = report("transfer plan", run_plan(*a)); });
}

}  // namespace

void register_transfer(CLI::App& app, Outcome& out) {
  auto* transfer = app.add_subcommand("transfer", "the weight transfer engine");
  transfer->require_subcommand(1);
  register_transfer_plan(*transfer, out);
  register_transfer_simulate(*transfer, out);
}

// The flags of `bench transfer` as strings, until the callback turns them into enums.
struct BenchTransferArgs {
  BenchTransferOptions o;
  std::string dtype = "bf16", mode = "p2p", shard_dtype = "bf16", ranks = "processes";
  bool as_rank = false;    // this process is one rank of a run (bench_transfer_rank)
  double memcpy_gbps = 0;  // a rank's: what the starting process measured
};

Status run_bench_transfer(BenchTransferArgs a) {
  WL_ASSIGN_OR_RETURN(a.o.format, parse_format(a.dtype));
  WL_ASSIGN_OR_RETURN(a.o.shard_dtype, parse_shard_dtype(a.shard_dtype));
  WL_ASSIGN_OR_RETURN(a.o.mode, parse_mode(a.mode));
  WL_ASSIGN_OR_RETURN(a.o.threads, parse_choice<bool>("--ranks", a.ranks,
                                                      {{"processes", false}, {"threads", true}}));
  WL_ASSIGN_OR_RETURN(std::string report,
                      a.as_rank ? bench_transfer_rank(a.o, a.memcpy_gbps) : bench_transfer(a.o));
  std::fputs(report.c_str(), stdout);
  return ok_status();
}

void register_bench_transfer(CLI::App& bench, Outcome& out) {
  auto* cmd = bench.add_subcommand("transfer", "time weight updates trainer -> receivers");
  auto a = std::make_shared<BenchTransferArgs>();
  BenchTransferOptions& o = a->o;
  cmd->add_option("--preset", o.preset)->capture_default_str();
  cmd->add_option("--model-dir", o.model_dir,
                  "a Hugging Face checkpoint directory: its shapes instead of the preset's");
  cmd->add_option("--trainers", o.trainers)->capture_default_str()->transform(count(1, kMaxRanks));
  cmd->add_option("--mesh-size", o.mesh_size,
                  "trainer ranks per FSDP mesh, each mesh a replica of the model (0: one mesh of "
                  "them all)")
      ->capture_default_str()
      ->transform(count(0, kMaxRanks));
  cmd->add_option("--receivers", o.receivers)
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--tp", o.tp)->capture_default_str()->transform(count(1, kMaxRanks));
  cmd->add_option("--dtype", a->dtype, "what receivers hold: bf16 or fp8")->capture_default_str();
  cmd->add_option("--mode", a->mode, "p2p, broadcast or naive")->capture_default_str();
  cmd->add_option("--shard-dtype", a->shard_dtype, "what trainers hold: bf16 or f32")
      ->capture_default_str();
  cmd->add_option("--ranks", a->ranks, "processes (one per rank) or threads (of this process)")
      ->capture_default_str();
  cmd->add_option("--updates", o.updates, "timed updates")
      ->capture_default_str()
      ->transform(count(1, 1000000));
  cmd->add_option("--watermark-bytes", o.watermark_bytes)
      ->capture_default_str()
      ->transform(bytes(1, kTiB));
  cmd->add_option("--bucket-bytes", o.bucket_bytes)
      ->capture_default_str()
      ->transform(bytes(1, kTiB));
  cmd->add_option("--timeout", o.timeout_s, "seconds any rank waits for any step")
      ->capture_default_str()
      ->transform(seconds());
  cmd->add_option("--memcpy-bytes", o.memcpy_bytes, "buffer of the copy-rate measurement")
      ->capture_default_str()
      ->transform(bytes(1, kTiB));
  cmd->add_flag("--verify,!--no-verify", o.verify, "check receivers against the reference");
  cmd->add_flag("--json", o.json, "one JSON object");
  cmd->add_flag("--as-rank", a->as_rank, "(internal) one rank of a process run")->group("");
  cmd->add_option("--memcpy-gbps", a->memcpy_gbps, "(internal) the starting process's copy rate")
      ->group("");
  cmd->callback([&out, a] { out.exit_code = report("bench transfer", run_bench_transfer(*a)); });
}

}  // namespace wl::app
