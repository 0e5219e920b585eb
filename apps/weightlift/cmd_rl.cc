// `weightlift rl`: RL post-training across processes (rl/loop.h), run under `weightlift launch`.
// Rank 0 trains and orchestrates, ranks 1..--trainers-1 train with it (data parallel), every
// other rank is a rollout worker. Rank 0 writes into
// --out: rl_metrics.jsonl (one line per step), summary.json, report.html, reward.svg, the
// trained policy (model.safetensors, config.json: `weightlift generate --run` reads them) and,
// with the workers, processes.json.
#include <atomic>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "report/progress.h"
#include "report/rl_report.h"
#include "stop_signals.h"
#include "validate.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/comm/store/tcp_store.h"
#include "weightlift/core/file_io.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/core/timing.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/model/params.h"
#include "weightlift/parallel/run/job.h"
#include "weightlift/parallel/run/trainer.h"
#include "weightlift/rl/checkpoint.h"
#include "weightlift/rl/loop.h"
#include "weightlift/train/run.h"

namespace wl::app {
namespace {

namespace fs = std::filesystem;

// The trainer's rank 0 ends the run after the step it is in on SIGTERM or SIGINT, its records,
// summary, report and policy written; the same signal again kills.
void stop_on_signals(rl::RlOptions& o) {
  catch_stop_signals({SIGTERM, SIGINT});
  o.stop_requested = [] {
    const int sig = stop_signal().load();
    if (sig == 0) return false;
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      std::fprintf(stderr, "\nrl: %s: ending the run after this step (again to kill)\n",
                   stop_signal_name(sig).c_str());
    }
    return true;
  };
}

struct RlArgs {
  rl::RlOptions o;
  std::string preset = "small";
  // A trained run's directory (config.json, model.safetensors) to start from, instead of
  // random weights of --preset.
  std::string init_weights;
  std::string model_dir;  // or a Hugging Face checkpoint (of weightlift's byte vocabulary)
  std::string task = "add";
  std::string verifier = "exact";
  double reward_timeout_s = 60;
  std::string out_dir = "runs/rl";
  bool overwrite = false;
  bool dr_grpo = false;
  bool no_dynamic_sampling = false;
  std::string sync_dtype = "bf16";
  std::string trainer_dp_mode = "ddp";
  std::optional<double> capacity_factor;  // replaces the config's when given
  int trainer_threads = 0;
  double timeout_s = 120;
  bool join = false;  // a rollout worker joining a running job
};

// --out must be a directory of ours to write: another run's results are kept unless
// --overwrite.
// What a resume must not change, by flag name: everything that decides what the next step
// samples and how it trains (--steps may grow).
std::map<std::string, std::string> run_options(const RlArgs& a, int workers) {
  auto exact = [](double v) {  // the shortest text that reads back as v
    char b[32];
    const auto r = std::to_chars(b, b + sizeof b, v);
    return std::string(b, r.ptr);
  };
  const rl::RlOptions& o = a.o;
  return {{"preset", a.preset},  // or the --init-weights directory
          {"task", a.task},
          {"difficulty", std::to_string(o.task.difficulty)},
          {"dataset", o.task.dataset},
          {"reward", a.verifier},
          {"reward-cmd", o.task.reward_cmd},
          {"max-completion", std::to_string(o.task.max_completion_tokens)},
          {"tokenizer", o.task.tokenizer},
          {"format-reward", exact(o.task.format_reward)},
          {"seed", std::to_string(o.seed)},
          {"prompts", std::to_string(o.prompts)},
          {"group", std::to_string(o.group)},
          {"lr", exact(o.lr)},
          {"temperature", exact(o.sampling.temperature)},
          {"top-k", std::to_string(o.sampling.top_k)},
          {"top-p", exact(o.sampling.top_p)},
          {"clip-low", exact(o.loss.clip_low)},
          {"clip-high", exact(o.loss.clip_high)},
          {"tis-cap", exact(o.loss.tis_cap)},
          {"kl-coef", exact(o.loss.kl_coef)},
          {"dr-grpo", a.dr_grpo ? "true" : "false"},
          {"no-dynamic-sampling", a.no_dynamic_sampling ? "true" : "false"},
          {"routing-replay", o.routing_replay ? "true" : "false"},
          // As a checkpoint without the key reads it (rl/checkpoint.cc): dropless runs resume
          // from the checkpoints of before the key.
          {"capacity-factor",
           o.config.capacity_factor ? exact(*o.config.capacity_factor) : "(not set)"},
          {"eval-every", std::to_string(o.eval_every)},
          {"eval-problems", std::to_string(o.eval_problems)},
          {"max-staleness", std::to_string(o.max_staleness)},
          {"sync-dtype", a.sync_dtype},
          {"rollout-workers (launch -n, less the trainer)", std::to_string(workers)}};
}

// A resume of a run in --out continues it there (its files are replaced at the end).
Status check_out_dir(const RlArgs& a) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(a.out_dir, ec)) && !fs::is_directory(a.out_dir, ec))
    return invalid_argument("--out " + a.out_dir + " exists and is not a directory");
  const bool continuing =
      !a.o.resume.empty() && fs::weakly_canonical(fs::path(a.o.resume).parent_path(), ec) ==
                                 fs::weakly_canonical(a.out_dir, ec);
  std::vector<std::string> ours = {"rl_metrics.jsonl", "summary.json",      "report.html",
                                   "reward.svg",       "model.safetensors", "config.json"};
  if (fs::is_directory(a.out_dir, ec)) {
    for (const auto& e : fs::directory_iterator(a.out_dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("checkpoint-", 0) == 0) ours.push_back(name);
    }
  }
  for (const std::string& f : ours) {
    const std::string p = a.out_dir + "/" + f;
    if (!fs::exists(fs::symlink_status(p, ec)) || continuing) continue;
    if (f.rfind("checkpoint-", 0) == 0) {
      if (a.overwrite) continue;
      return invalid_argument("--out " + a.out_dir + " holds another run's checkpoints (" + f +
                              "); resume it (--resume) or pass --overwrite");
    }
    if (!a.overwrite) {
      return invalid_argument("--out " + a.out_dir + " already holds a run (" + f +
                              "); pass --overwrite to replace it");
    }
    WL_RETURN_IF_ERROR(check_output_path(p).with_context("--out"));
  }
  return ok_status();
}

// The trained policy as `weightlift generate --run` reads it.
Status write_policy(const std::string& dir, const model::ModelConfig& config,
                    std::vector<float>& policy, const std::string& model_dir,
                    const std::string& tokenizer) {
  WL_RETURN_IF_ERROR(model::save_config(config, dir + "/config.json"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  const model::ParamLayout layout(config);
  for (const model::ParamInfo& p : layout.params())
    tensors.emplace_back(p.name, Tensor::borrow(policy.data() + p.offset, DType::kF32, p.shape));
  WL_RETURN_IF_ERROR(write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}}));
  return parallel::write_hf_model(dir, config, policy, model_dir, tokenizer);
}

// The job's rollout workers: every engine_ranks() ranks after the trainer's.
int workers(const RlArgs& a, const parallel::Job& job) {
  return (job.size() - a.o.trainers) / a.o.engine_ranks();
}

// The command's flags as the loop's options; nothing is allocated or connected yet.
Status make_rl_options(RlArgs& a) {
  if (!a.model_dir.empty()) {
    WL_ASSIGN_OR_RETURN(const model::HfCheckpoint hf, model::open_hf_checkpoint(a.model_dir));
    // A checkpoint's own tokenizer, when it has one; else its vocabulary must be our bytes.
    const std::string own = a.model_dir + "/tokenizer.json";
    if (a.o.task.tokenizer.empty() && fs::is_regular_file(own)) a.o.task.tokenizer = own;
    if (a.o.task.tokenizer.empty() && hf.config.vocab_size != 320) {
      return invalid_argument("--model-dir " + a.model_dir + ": its vocabulary has " +
                              std::to_string(hf.config.vocab_size) +
                              " tokens and no tokenizer.json beside it (give --tokenizer); "
                              "without one rl speaks weightlift's byte vocabulary (320), as the "
                              "hf/ of a weightlift run does");
    }
    a.o.config = hf.config;
    a.o.init_model_dir = a.model_dir;
    a.preset = a.model_dir;
  } else if (a.init_weights.empty()) {
    WL_ASSIGN_OR_RETURN(a.o.config, model::preset(a.preset));
  } else {
    // The run's model: its config, and its weights once the trainer starts (rl/loop.h).
    const std::string config = a.init_weights + "/config.json";
    a.o.init_weights = a.init_weights + "/model.safetensors";
    if (!fs::is_regular_file(config) || !fs::is_regular_file(a.o.init_weights)) {
      return invalid_argument("--init-weights " + a.init_weights +
                              ": expected a trained run's directory holding config.json and "
                              "model.safetensors (the --out of weightlift train or rl)");
    }
    WL_ASSIGN_OR_RETURN(a.o.config, model::load_config(config));
    a.preset = a.init_weights;  // what the records, the summary and the report name
  }
  if (a.capacity_factor) a.o.config.capacity_factor = *a.capacity_factor;
  auto kind = rl::task_from_name(a.task);
  if (!kind) return invalid_argument("--task '" + a.task + "': expected add, sort or reverse");
  a.o.task.kind = *kind;
  auto verifier = rl::verifier_from_name(a.verifier);
  if (!verifier) {
    return invalid_argument("--reward '" + a.verifier + "': expected exact, number or boxed");
  }
  a.o.task.verifier = *verifier;
  a.o.task.reward_timeout = std::chrono::milliseconds(int64_t(a.reward_timeout_s * 1000));
  if (!a.o.task.dataset.empty()) a.task = a.o.task.dataset;  // what the records name
  a.o.advantages.normalize_std = !a.dr_grpo;
  a.o.dynamic_sampling = !a.no_dynamic_sampling;
  auto format = transfer::weight_format_from_name(a.sync_dtype);
  if (!format) return invalid_argument("--sync-dtype '" + a.sync_dtype + "': expected bf16 or fp8");
  a.o.sync_format = *format;
  auto dp_mode = parallel::dp_mode_from_name(a.trainer_dp_mode);
  if (!dp_mode) {
    return invalid_argument("--trainer-dp-mode '" + a.trainer_dp_mode +
                            "': expected ddp, zero1, zero2 or fsdp");
  }
  a.o.trainer_dp_mode = *dp_mode;
  WL_RETURN_IF_ERROR(rl::check_layouts(a.o));
  // Before anything is allocated or connected, on every process: what any rank may need.
  WL_RETURN_IF_ERROR(rl::check_memory(a.o));
  a.o.timeout = std::chrono::milliseconds(int64_t(a.timeout_s * 1000));
  a.o.checkpoint_dir = a.out_dir;
  a.o.metrics_path = a.out_dir + "/rl_metrics.jsonl";
  return ok_status();
}

// The trainer's hold on --out for the whole run: created, locked, checked again now that no
// other run can write there, and emptied of an earlier run's checkpoints under --overwrite
// (none of them may pass for ours).
Result<DirectoryLock> take_out_dir(const RlArgs& a) {
  WL_ASSIGN_OR_RETURN(DirectoryLock lock, train::hold_out_dir(a.out_dir, "--out"));
  WL_RETURN_IF_ERROR(check_out_dir(a));
  std::error_code ec;
  if (a.overwrite && a.o.resume.empty()) {
    for (const auto& e : fs::directory_iterator(a.out_dir, ec)) {
      if (e.path().filename().string().rfind("checkpoint-", 0) == 0) fs::remove_all(e.path(), ec);
    }
  }
  return lock;
}

// The trainer's run with its two progress bars (SFT, then RL).
Result<rl::RlSummary> train_with_progress(const RlArgs& a, parallel::Job& job) {
  ProgressBar sft_bar("sft", a.o.sft_steps, "steps"), rl_bar("rl", a.o.steps, "steps");
  double last_held = -1;
  Stopwatch phase_time, since_sft;  // since the phase began; since the last SFT step ended
  int64_t phase_first_step = 1;     // a resumed run's RL starts later
  auto on_step = [&](const rl::StepRecord& r) {
    if (r.held_out_accuracy >= 0) last_held = r.held_out_accuracy;
    char status[160];
    char held[16] = "-";
    if (last_held >= 0) std::snprintf(held, sizeof held, "%.0f%%", 100 * last_held);
    const double rate =
        double(r.step - phase_first_step + 1) / std::max(1e-9, phase_time.seconds());
    if (r.phase == "sft") {
      std::snprintf(status, sizeof status, "loss %.3f  held-out %s", r.loss, held);
      since_sft.restart();
      sft_bar.update(r.step, rate, "steps/s", status);
    } else {
      // The step's staleness: the oldest sample it trained on, in versions.
      const int64_t stale = r.staleness.empty() ? 0 : int64_t(r.staleness.size()) - 1;
      std::snprintf(
          status, sizeof status,
          "reward %.2f  held-out %s  staleness %lld  %.0f tok/s  filtered %lld", r.reward_mean,
          held, (long long)stale,
          r.step_s > 0 ? r.response_tokens * double(a.o.prompts * a.o.group) / r.step_s : 0.0,
          (long long)r.groups_filtered);
      rl_bar.update(r.step, rate, "steps/s", status);
    }
  };
  bool rl_started = false;
  Result<rl::RlSummary> s =
      rl::run_trainer(a.o, job.world.store, workers(a, job), [&](const rl::StepRecord& r) {
        if (r.phase == "rl" && !rl_started) {
          rl_started = true;
          sft_bar.finish();
          phase_time = since_sft;  // RL began when the last SFT step ended
          phase_first_step = r.step;
        }
        on_step(r);
      });
  rl_bar.finish();
  return s;
}

// "add difficulty 3", or the dataset with how it is scored and tokenized.
std::string task_label(const RlArgs& a) {
  const rl::TaskOptions& t = a.o.task;
  if (t.dataset.empty()) return a.task + " difficulty " + std::to_string(t.difficulty);
  return t.dataset + " (" +
         (t.reward_cmd.empty() ? "the " + a.verifier + " verifier" : "`" + t.reward_cmd + "`") +
         ", " + (t.tokenizer.empty() ? "bytes" : t.tokenizer) + ")";
}

// "ddp", or with model parallelism "fsdp, tp 2" / "ddp, ep 2" / "ddp, pp 2".
std::string trainer_label(const RlArgs& a) {
  std::string l = a.trainer_dp_mode;
  if (a.o.trainer_tp > 1) l += ", tp " + std::to_string(a.o.trainer_tp);
  if (a.o.trainer_ep > 1) l += ", ep " + std::to_string(a.o.trainer_ep);
  if (a.o.trainer_pp > 1) l += ", pp " + std::to_string(a.o.trainer_pp);
  return l;
}

// The finished run's files: the policy, summary.json, the reward plot and the report.
// `seconds`: the run's wall time on the trainer, warm start and evaluations included.
Status write_rl_outputs(const RlArgs& a, const parallel::Job& job, rl::RlSummary& s,
                        double seconds) {
  WL_RETURN_IF_ERROR(
      write_policy(a.out_dir, a.o.config, s.policy, a.model_dir, a.o.task.tokenizer));
  nlohmann::json summary = {
      {"task", a.task},
      {"difficulty", a.o.task.difficulty},
      {"preset", a.preset},
      {"mode", a.o.max_staleness == 0 ? "synchronous" : "asynchronous"},
      {"max_staleness", a.o.max_staleness},
      {"routing_replay", a.o.routing_replay},
      {"rollout_workers", workers(a, job)},
      {"trainer_ranks", a.o.trainers},
      {"trainer_dp_mode", a.trainer_dp_mode},
      {"trainer_tp", a.o.trainer_tp},
      {"trainer_ep", a.o.trainer_ep},
      {"trainer_pp", a.o.trainer_pp},
      {"capacity_factor",
       a.o.config.capacity_factor ? nlohmann::json(*a.o.config.capacity_factor) : nlohmann::json()},
      {"rollout_tp", a.o.rollout_tp},
      {"rollout_ep", a.o.rollout_ep},
      {"rollout_slots", a.o.rollout_slots},
      {"rollout_bf16_activations", a.o.rollout_bf16_activations},
      {"rollout_widen_per_generation", a.o.rollout_widen_per_generation},
      {"group", a.o.group},
      {"prompts_per_step", a.o.prompts},
      {"seed", a.o.seed},
      {"sft_steps", s.sft_steps},
      {"steps", a.o.steps},
      {"rl_steps_run", s.rl_steps},
      {"stopped_early", s.stopped},
      {"held_out_problems", a.o.eval_problems},
      {"accuracy_before", s.held_out_before_rl},
      {"accuracy_after", s.held_out_after_rl},
      {"seconds", seconds}};
  summary.update(rl_figures(s));
  WL_RETURN_IF_ERROR(write_file_atomically(a.out_dir + "/summary.json", summary.dump(1) + "\n"));
  WL_RETURN_IF_ERROR(write_rl_reward_plot(a.out_dir + "/reward.svg", s));
  char title[512];
  std::snprintf(title, sizeof title,
                "weightlift rl: %s, %s, %d trainer rank(s), %d rollout worker(s)",
                task_label(a).c_str(), a.preset.c_str(), a.o.trainers, workers(a, job));
  WL_RETURN_IF_ERROR(write_rl_report(a.out_dir + "/report.html", title, summary, s));
  std::printf(
      "rl: held-out accuracy %.1f%% after SFT (%lld steps), %.1f%% after %lld RL steps; "
      "weight sync %.1f%% of the step time\nrl: report %s/report.html\n",
      100 * s.held_out_before_rl, (long long)s.sft_steps, 100 * s.held_out_after_rl,
      (long long)s.rl_steps,
      100 * (summary["sync_share"].is_number() ? summary["sync_share"].get<double>() : 0.0),
      a.out_dir.c_str());
  return ok_status();
}

// The job fits the layout: the trainer's ranks, then whole rollout workers; and a process
// started again (WEIGHTLIFT_RESTART) is one that can be.
Status check_job(const RlArgs& a, const comm::LaunchEnv& env) {
  const int engine = a.o.engine_ranks();
  const int least = a.o.trainers + engine;
  if (env.world_size < least || (env.world_size - a.o.trainers) % engine != 0) {
    const std::string t = std::to_string(a.o.trainers), n = std::to_string(engine);
    const std::string flag = a.o.rollout_ep == 1   ? "--rollout-tp "
                             : a.o.rollout_tp == 1 ? "--rollout-ep "
                                                   : "--rollout-tp x --rollout-ep = ";
    return invalid_argument(
        "rl runs --trainers " + t + " trainer rank(s), then rollout workers of " + flag + n +
        " process(es) each: at least " + std::to_string(least) + " processes, " + t +
        " plus a multiple of " + n + "; this job has " + std::to_string(env.world_size) +
        " (weightlift launch -n " + std::to_string(least) + " weightlift rl ...)");
  }
  // A rollout worker of one rank can be replaced mid-run; the trainer holds the run, and
  // cannot, nor can one rank of a TP or EP engine rejoin its running peers.
  if (std::getenv("WEIGHTLIFT_RESTART") == nullptr) return ok_status();
  if (env.rank < a.o.trainers) {
    return failed_precondition("trainer rank " + std::to_string(env.rank) +
                               " was lost and cannot be replaced mid-run: start the job again "
                               "with --resume and its last checkpoint in " +
                               a.out_dir);
  }
  if (a.o.engine_ranks() > 1) {
    return failed_precondition(
        "rank " + std::to_string(env.rank) + " was one rank of a rollout worker of " +
        std::to_string(a.o.engine_ranks()) + " processes (--rollout-tp " +
        std::to_string(a.o.rollout_tp) + ", --rollout-ep " + std::to_string(a.o.rollout_ep) +
        "), which cannot be replaced mid-run; the run goes on "
        "without that worker");
  }
  return ok_status();
}

// What job rank `rank` is: a trainer rank, or engine rank `rank` of rollout worker `worker`
// (from 1: job ranks trainers + (worker - 1) * engine_ranks() on, one per TP or EP rank), and
// its role in processes.json.
struct Place {
  int worker = 0;  // 0: a trainer rank
  int rank = 0;    // in the worker's engine
  std::string role;
};

Place place_of(const RlArgs& a, int rank) {
  if (rank < a.o.trainers)
    return {.role = rank == 0 ? "trainer" : "trainer-rank-" + std::to_string(rank)};
  const int after = rank - a.o.trainers;
  Place p{.worker = after / a.o.engine_ranks() + 1, .rank = after % a.o.engine_ranks()};
  p.role = "rollout-worker-" + std::to_string(p.worker);
  // As train names its ranks: the EP rank, then the TP rank.
  if (a.o.rollout_ep > 1) p.role += "-ep-rank-" + std::to_string(p.rank / a.o.rollout_tp);
  if (a.o.rollout_tp > 1) p.role += "-tp-rank-" + std::to_string(p.rank % a.o.rollout_tp);
  return p;
}

// A rollout worker joining a running job: its store and nothing more, no rank of the job's.
Status join_rl(const RlArgs& a) {
  WL_RETURN_IF_ERROR(rl::check_joining(a.o));
  WL_ASSIGN_OR_RETURN(comm::LaunchEnv env, comm::read_launch_env());
  if (env.job_token.empty()) {
    return invalid_argument(
        "--join: WEIGHTLIFT_JOB_TOKEN is not set; export the running job's token (and "
        "MASTER_ADDR, MASTER_PORT: where its store is)");
  }
  env.store_hosted = true;  // the job's own launcher or rank 0 hosts it
  WL_ASSIGN_OR_RETURN(const comm::World world, comm::connect_store(env, a.o.timeout));
  rl::RlOptions o = a.o;
  o.on_event = [](const rl::RlEvent& e) { std::fprintf(stderr, "rl: %s\n", e.what.c_str()); };
  return rl::run_joining_worker(o, world.store);
}

Status run_rl(RlArgs a) {
  WL_RETURN_IF_ERROR(make_rl_options(a));
  if (a.join) return join_rl(a);
  WL_ASSIGN_OR_RETURN(comm::LaunchEnv env, comm::read_launch_env());
  WL_RETURN_IF_ERROR(check_job(a, env));
  // Only the trainer writes into --out (a replaced worker starts while the run is there).
  if (env.rank == 0) WL_RETURN_IF_ERROR(check_out_dir(a));
  // The job's store and nothing more: the RL processes make their channels through it
  // (rl/loop.h), so a replaced worker joins a running job without a world to rejoin.
  parallel::Job job;
  WL_ASSIGN_OR_RETURN(job.world, comm::connect_store(env, a.o.timeout));
  a.o.run = run_options(a, workers(a, job));
  std::optional<DirectoryLock> lock;
  if (env.rank == 0) {
    WL_ASSIGN_OR_RETURN(lock, take_out_dir(a));
  }
  const Place place = place_of(a, job.rank());
  const std::string& role = place.role;
  WL_RETURN_IF_ERROR(parallel::write_processes(job, a.out_dir, role, a.o.timeout));
  a.o.on_event = [](const rl::RlEvent& e) {
    std::fprintf(stderr, "rl: %s step %lld: %s\n", e.phase.c_str(), (long long)e.step,
                 e.what.c_str());
  };
  if (place.worker >= 1)
    return rl::run_rollout_worker(a.o, job.world.store, place.worker, place.rank);
  // In synchronous mode the workers wait while the trainer computes: it may take every core.
  if (a.trainer_threads > 0) set_num_threads(a.trainer_threads);
  if (job.rank() != 0)
    return rl::run_trainer_rank(a.o, job.world.store, job.rank(), workers(a, job));
  a.o.on_rejoin = [&](int k) {
    const Status s = parallel::write_processes(job, a.out_dir, role, a.o.timeout);
    if (!s.ok()) {
      std::fprintf(stderr, "rl: rollout worker %d rejoined; processes.json not rewritten: %s\n", k,
                   s.to_string().c_str());
    }
  };
  std::printf(
      "rl: %s, task %s, %d trainer rank(s) (%s), %d rollout worker(s), %lld "
      "prompts x %lld samples per step\n",
      a.preset.c_str(), task_label(a).c_str(), a.o.trainers, trainer_label(a).c_str(),
      workers(a, job), (long long)a.o.prompts, (long long)a.o.group);
  std::fflush(stdout);

  stop_on_signals(a.o);
  // rl_metrics.jsonl grows as the run goes (rl::RlOptions::metrics_path).
  const Stopwatch run_time;
  Result<rl::RlSummary> s = train_with_progress(a, job);
  WL_RETURN_IF_ERROR(s.status());
  return write_rl_outputs(a, job, *s, run_time.seconds());
}

// The model, the task and the supervised warm start.
void add_task_flags(CLI::App* cmd, RlArgs& a) {
  rl::RlOptions& o = a.o;
  auto* preset = cmd->add_option("--preset", a.preset, "model preset, from random weights")
                     ->capture_default_str();
  cmd->add_option("--init-weights", a.init_weights,
                  "start from a trained run's model instead (its --out: config.json and "
                  "model.safetensors)")
      ->excludes(preset);
  cmd->add_option("--model-dir", a.model_dir,
                  "start from a Hugging Face checkpoint (a run's hf/: weightlift's byte "
                  "vocabulary)")
      ->excludes(preset)
      ->excludes("--init-weights");
  cmd->add_option("--task", a.task, "add, sort or reverse")->capture_default_str();
  cmd->add_option("--difficulty", o.task.difficulty, "largest operand size, 1-9")
      ->capture_default_str()
      ->transform(count(1, 9));
  cmd->add_option("--format-reward", o.task.format_reward, "reward of a well-formed wrong answer")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1, .hi_open = true}));
  cmd->add_option("--dataset", o.task.dataset,
                  "prompts from a JSONL file ({\"prompt\": ..., \"answer\": ...} per line) "
                  "instead of --task's generated problems");
  cmd->add_option("--reward", a.verifier,
                  "how a --dataset completion is scored against its answer: exact (normalised "
                  "text), number (GSM8K's #### or the last number) or boxed (\\boxed{})")
      ->capture_default_str();
  cmd->add_option("--reward-cmd", o.task.reward_cmd,
                  "score --dataset completions with this command instead: JSON lines in "
                  "({prompt, completion, ended, row}) and out ({\"reward\": r})");
  cmd->add_option("--reward-timeout", a.reward_timeout_s,
                  "seconds the reward command may take for one group's samples")
      ->capture_default_str()
      ->transform(real(kPositive));
  cmd->add_option("--tokenizer", o.task.tokenizer,
                  "a Hugging Face tokenizer.json for --dataset's text (default: --model-dir's "
                  "own, else weightlift's bytes)");
  cmd->add_option("--max-completion", o.task.max_completion_tokens,
                  "longest --dataset completion, in tokens (0: the longest answer)")
      ->capture_default_str()
      ->transform(count(0, 1 << 20));
  cmd->add_option("--seed", o.seed)->capture_default_str()->transform(u64());
  cmd->add_option("--sft-steps", o.sft_steps, "warm-start steps at most")
      ->capture_default_str()
      ->transform(count(0, kMaxSteps));
  cmd->add_option("--sft-batch", o.sft_batch)->capture_default_str()->transform(count(1, kMaxRows));
  cmd->add_option("--sft-lr", o.sft_lr)->capture_default_str()->transform(real(kPositive));
  cmd->add_option("--sft-target", o.sft_target, "held-out accuracy that ends the warm start")
      ->capture_default_str()
      ->transform(real(kProbability));
  cmd->add_option("--sft-eval-every", o.sft_eval_every,
                  "SFT steps between held-out evaluations (each may end the warm start)")
      ->capture_default_str()
      ->transform(count(1, kMaxSteps));
}

// The RL steps: batch, sampling and the policy loss.
void add_policy_flags(CLI::App* cmd, RlArgs& a) {
  rl::RlOptions& o = a.o;
  cmd->add_option("--steps", o.steps, "RL steps")
      ->capture_default_str()
      ->transform(count(0, kMaxSteps));
  cmd->add_option("--prompts", o.prompts, "groups per step")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--group", o.group, "samples per prompt (G)")
      ->capture_default_str()
      ->transform(count(1, kMaxRows));
  cmd->add_option("--lr", o.lr)->capture_default_str()->transform(real(kPositive));
  cmd->add_option("--temperature", o.sampling.temperature)
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1e6, .lo_open = true}));
  cmd->add_option("--top-k", o.sampling.top_k, "0 = off")
      ->capture_default_str()
      ->transform(count(0, kMaxRows));
  cmd->add_option("--top-p", o.sampling.top_p, "1 = off")
      ->capture_default_str()
      ->transform(real(kProbability));
  cmd->add_option("--clip-low", o.loss.clip_low)
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = 1}));
  cmd->add_option("--clip-high", o.loss.clip_high)
      ->capture_default_str()
      ->transform(real(kNonNegative));
  cmd->add_option("--tis-cap", o.loss.tis_cap, "truncated importance weight cap; 0 = off")
      ->capture_default_str()
      ->transform(real(kNonNegative));
  cmd->add_option("--kl-coef", o.loss.kl_coef,
                  "weight of the KL penalty to the policy RL starts from (k3 estimator); 0 = off")
      ->capture_default_str()
      ->transform(real(kNonNegative));
  cmd->add_flag("--dr-grpo", a.dr_grpo, "advantages without the division by the group's std");
  cmd->add_flag("--no-dynamic-sampling", a.no_dynamic_sampling,
                "train on groups whose rewards are all equal instead of replacing them");
  cmd->add_option("--capacity-factor", a.capacity_factor,
                  "token dropping in the trainer and the rollout engines: each expert takes at "
                  "most this many times its even share of a pass's routing slots, the rest "
                  "pass through the residual (replaces the config's; with --routing-replay the "
                  "trainer replays the rollout's drops)")
      ->transform(real(kPositive));
  cmd->add_flag("--routing-replay", o.routing_replay,
                "R3: the trainer routes every token to the experts the rollout's router chose "
                "(the router still learns through the gate weights)");
}

// The trainer's ranks: how many, how they share the model, their threads.
void add_trainer_flags(CLI::App* cmd, RlArgs& a) {
  rl::RlOptions& o = a.o;
  cmd->add_option("--trainers", o.trainers,
                  "trainer ranks: job ranks 0..N-1 train (laid out by the --trainer-* flags), "
                  "each pushing its own shard of the weights to the workers; the rest are "
                  "rollout workers")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--trainer-dp-mode", a.trainer_dp_mode,
                  "how the trainer ranks share the model: ddp, zero1, zero2 or fsdp (each rank "
                  "holds and pushes only its shard of the weights)")
      ->capture_default_str();
  cmd->add_option("--trainer-tp", o.trainer_tp,
                  "tensor-parallel trainer ranks: groups of this many consecutive trainer ranks "
                  "split every block's heads and ffn rows (it divides --trainers)")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--trainer-pp", o.trainer_pp,
                  "pipeline stages of the trainer, each its own ranks holding a run of the "
                  "layers (trainers = stages x data-parallel x --trainer-tp)")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--trainer-ep", o.trainer_ep,
                  "expert-parallel trainer ranks: groups of this many data-parallel ranks share "
                  "out each layer's experts, each holding and running only its own")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--trainer-threads", a.trainer_threads,
                  "compute threads of each trainer rank instead of --threads: they compute "
                  "while the workers wait (0 = --threads)")
      ->capture_default_str()
      ->transform(count(0, kMaxThreads));
}

// How the run syncs, overlaps, checkpoints, evaluates, and where it writes.
void add_run_flags(CLI::App* cmd, RlArgs& a) {
  rl::RlOptions& o = a.o;
  cmd->add_option("--sync-dtype", a.sync_dtype,
                  "how rollout workers hold the weights the trainer pushes: bf16 or fp8")
      ->capture_default_str();
  cmd->add_option("--rollout-tp", o.rollout_tp,
                  "TP ranks (processes) of each rollout worker, each holding its slices of the "
                  "weights; the job's ranks after the trainer's are the workers' in turn")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--rollout-ep", o.rollout_ep,
                  "EP ranks of each rollout worker (times its TP ranks): each holds one run of "
                  "the experts and generates its share of the prompts, tokens going to their "
                  "experts' ranks and back")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
  cmd->add_option("--rollout-slots", o.rollout_slots,
                  "rows each rollout worker decodes at once (continuous batching: a finished "
                  "row's slot takes the next prompt at once); 0: every row of a request")
      ->capture_default_str()
      ->transform(count(0, kMaxRows));
  cmd->add_flag("--rollout-bf16-activations", o.rollout_bf16_activations,
                "the rollout engines multiply bf16 weights as stored against bf16-rounded "
                "activations where the CPU has bf16 GEMMs (a larger trainer/sampler mismatch)");
  cmd->add_flag("--rollout-widen-per-generation", o.rollout_widen_per_generation,
                "the rollout engines widen their weights to f32 once per request instead of a "
                "band per decode step: faster on long responses, slower on short ones (every "
                "expert is widened, used or not), an f32 copy of the weights held meanwhile");
  cmd->add_option("--max-staleness", o.max_staleness,
                  "eta: 0 = synchronous; from 1, generation overlaps training and no sample "
                  "more than eta policy versions old is trained on")
      ->capture_default_str()
      ->transform(count(0, 1000));
  cmd->add_option("--checkpoint-every", o.checkpoint_every,
                  "RL steps between checkpoints into --out/checkpoint-<step> (0 = none)")
      ->capture_default_str()
      ->transform(count(0, kMaxSteps));
  cmd->add_option("--resume", o.resume,
                  "continue the run of this checkpoint (--out/checkpoint-<step>) to --steps");
  cmd->add_option("--eval-every", o.eval_every)
      ->capture_default_str()
      ->transform(count(1, kMaxSteps));
  cmd->add_option("--eval-problems", o.eval_problems, "held-out problems")
      ->capture_default_str()
      ->transform(count(1, 100000));
  cmd->add_option("--out", a.out_dir)->capture_default_str();
  cmd->add_flag("--overwrite", a.overwrite, "replace the results of an earlier run in --out");
  cmd->add_flag("--join", a.join,
                "be one more rollout worker of a running job: MASTER_ADDR, MASTER_PORT and "
                "WEIGHTLIFT_JOB_TOKEN name the job's store, and the flags must be the job's "
                "(the model, --sync-dtype and sampling are checked before anything connects)");
  cmd->add_option("--timeout", a.timeout_s, "seconds, every wait between processes")
      ->capture_default_str()
      ->transform(real({.lo = 0, .hi = double(kMaxSeconds), .lo_open = true}));
  cmd->add_option("--kill-worker-after-sync", o.kill_worker_after_sync,
                  "failure injection: the trainer kills rollout worker --kill-worker right "
                  "after this RL step's weight update (0 = never)")
      ->capture_default_str()
      ->transform(count(0, kMaxSteps));
  cmd->add_option("--kill-worker", o.kill_worker, "the worker --kill-worker-after-sync kills")
      ->capture_default_str()
      ->transform(count(1, kMaxRanks));
}

}  // namespace

void register_rl(CLI::App& app, Outcome& out) {
  auto* cmd = app.add_subcommand(
      "rl", "RL post-training: a trainer and rollout workers (run under weightlift launch)");
  auto a = std::make_shared<RlArgs>();
  add_task_flags(cmd, *a);
  add_policy_flags(cmd, *a);
  add_trainer_flags(cmd, *a);
  add_run_flags(cmd, *a);
  cmd->callback([&out, a] { out.exit_code = report("rl", run_rl(*a)); });
}

}  // namespace wl::app
