// The RL post-training loop across processes: synchronous (every sample from the weights of
// the step before) or asynchronous within a staleness bound (RlOptions::max_staleness).
//
//   rank 0        trainer, orchestrator and parameter server: SFT warm start on the task's
//                 demonstrations (generated, or a dataset's answers), then per step: push the
//                 weights to every rollout worker through the p2p engine
//                 (transfer/fleet/parameter_server.h), send each worker its share of the step's
//                 prompts (each repeated G times), score what comes back (the task's rules, a
//                 verifier or the user's reward process: tasks.h), GRPO advantages per group,
//                 groups whose rewards are all equal filtered out and replaced from fresh
//                 prompts (DAPO's dynamic sampling), one policy step (policy_step.h)
//   ranks 1..T-1  with `trainers` T > 1, the other data-parallel ranks of the trainer (DDP or
//                 ZeRO-1/2: each holds the whole model after a step). Rank 0 tells them each
//                 step it takes (the batch it built) and they take it with it; each is also a
//                 parameter-server rank, and pushes its own dim-0 shard of every parameter
//                 to the workers from its own weights, so no rank gathers the model
//   the rest      rollout workers 1..W, each `rollout_tp` x `rollout_ep` consecutive ranks
//                 (an inference engine's TP or EP ranks): a fleet receiver holding its slices
//                 of the pushed weights (bf16 or fp8; under EP every weight but the experts,
//                 and one run of those) and an inference worker generating from them with the
//                 KV cache and the sampling options, returning every token with its
//                 log-probability under the distribution sampled from and the weights'
//                 version. Engine rank 0 talks to the trainer and passes every command on to
//                 the others
//
// Where each part lives:
//   protocol.h        the messages between these processes and the store keys they meet by
//   orchestrator.h    the step's decisions, talking to nobody: rounds, kept samples, staleness,
//                     dynamic sampling, when to push
//   rollout_fleet.h   the workers as rank 0 sees them: requests, replies, losses, replacements
//   trainer.cc        run_trainer and run_trainer_rank: the trainer's ranks and the run
//   rollout_worker.cc run_rollout_worker: one engine's process
//   checks.h          what the options must fit before anything connects
//
// Control messages (which prompts, what came back) travel over UCX, as every byte between
// processes does: one two-rank group per worker incarnation, made through the job's store; the
// weights over the fleet's p2p puts. Every wait has the run's timeout. A worker that dies is
// dropped (an event in the run's records): its share of a generation goes to the others, the
// next weight update forms a fleet generation without it, and a replacement of the same rank
// (`weightlift launch --restart-failed`, or started by hand with the same variables) heals its
// weights from a peer or the servers' copy and rejoins at the next step. With every worker
// lost and none replaced within the timeout, the run ends with an error.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "weightlift/comm/store/store.h"
#include "weightlift/kernels/sampling.h"
#include "weightlift/model/config.h"
#include "weightlift/parallel/layout/layout.h"
#include "weightlift/rl/policy_loss.h"
#include "weightlift/rl/policy_step.h"
#include "weightlift/rl/records.h"
#include "weightlift/rl/tasks.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::rl {

struct RlOptions {
  model::ModelConfig config;
  TaskOptions task;
  // The trainer's ranks (job ranks 0..trainers-1) and how they share the model: data
  // parallel as DDP, ZeRO-1 or ZeRO-2 (each rank ends a step holding the whole model) or FSDP
  // (each holds only its dim-0 shard of every parameter), over trainers / trainer_tp ranks;
  // groups of trainer_tp consecutive ranks splitting every block's heads and ffn rows,
  // groups of trainer_ep data-parallel ranks sharing out the experts, and trainer_pp pipeline
  // stages (parallel/layout.h).
  // The servers that feed the workers hold core/shard.h's rows of every parameter over all
  // trainer ranks: where the layout keeps other parts (tensor bands, expert runs), each rank
  // sends the others the pieces of its own that belong to their shards (parallel/run/
  // row_shards.h), so no rank gathers the model to push it (the KL term's reference policy
  // and the finished policy are gathered on rank 0, once each).
  int trainers = 1;
  parallel::DpMode trainer_dp_mode = parallel::DpMode::kDdp;
  int trainer_tp = 1;
  int trainer_ep = 1;
  // Pipeline stages, each its own trainer ranks (stage-major, as train's), every RL and SFT
  // batch one micro-batch (the stages take turns, which on these cores costs nothing).
  int trainer_pp = 1;
  parallel::ParallelLayout trainer_layout() const {
    return {.dp_mode = trainer_dp_mode,
            .dp = trainers / std::max(trainer_tp * trainer_pp, 1),
            .pp = trainer_pp,
            .tp = trainer_tp,
            .ep = trainer_ep};
  }
  // Each rollout worker is an inference engine of this many TP ranks (processes), each holding
  // its slices of the weights (transfer/layout/inference_layout.h) and receiving them from the
  // trainer's ranks directly. A worker of several ranks cannot be replaced mid-run: losing one
  // of its ranks loses the worker.
  int rollout_tp = 1;
  // ... and of this many EP ranks, each holding one run of the experts and generating its
  // share of the rows (infer/worker.h): an engine of rollout_tp x rollout_ep ranks, engine
  // rank r being TP rank r % rollout_tp of EP rank r / rollout_tp.
  int rollout_ep = 1;
  // The processes of one rollout worker.
  int engine_ranks() const { return rollout_tp * rollout_ep; }
  // Rows each rollout worker (each EP rank of one) decodes at once, continuous batching
  // (infer::GenerateOptions::slots); 0: every row of a request at once. Samples do not
  // depend on it.
  int64_t rollout_slots = 0;
  // The rollout engines multiply bf16 weights as stored against bf16-rounded activations,
  // where the CPU has bf16 GEMMs (infer::WorkerOptions::bf16_activations): a second rounding
  // in the sampler, which the trainer's importance weights see as a larger mismatch.
  bool rollout_bf16_activations = false;
  // Each rollout engine widens its weights to f32 once per generation instead of a band per
  // decode step (infer::WorkerOptions::widen_per_generation), for an f32 copy of the weights
  // held while a request runs: it pays over many decode steps and costs on a few (every expert
  // is widened, used or not). The same tokens; a worker's own choice, so not part of the job's
  // identity.
  bool rollout_widen_per_generation = false;
  uint64_t seed = 1;
  // The policy RL starts from: a safetensors file of `config`'s parameters (a trained run's
  // model.safetensors), read by every trainer rank; empty: random weights drawn from `seed`.
  std::string init_weights;
  // Or a Hugging Face checkpoint directory of `config` (model/hf_checkpoint.h).
  std::string init_model_dir;
  // SFT warm start: up to sft_steps steps of sft_batch demonstrations, stopped early once the
  // held-out accuracy (greedy) reaches sft_target, so RL starts from a model that is partly
  // right, as public recipes do before sparse rewards.
  int64_t sft_steps = 300;
  int64_t sft_batch = 32;
  double sft_lr = 3e-3;
  double sft_target = 0.3;
  int64_t sft_eval_every = 10;  // SFT steps between held-out evaluations (and stop checks)
  // RL.
  int64_t steps = 40;
  int64_t prompts = 8;  // groups per step
  int64_t group = 8;    // samples per prompt (G)
  double lr = 5e-4;
  kernels::SamplingOptions sampling{.temperature = 1.0f};
  // How the workers hold the weights, and so what the sync moves: bf16, or fp8 e4m3 with a
  // scale per 128x128 block (the trainer quantizes; half the bytes, a larger mismatch).
  transfer::WeightFormat sync_format = transfer::WeightFormat::kBF16;
  AdvantageOptions advantages;
  PolicyLossOptions loss;
  bool dynamic_sampling = true;
  int64_t max_resample_rounds = 4;  // generations per step at most when groups are filtered
  int64_t eval_every = 10;          // steps between held-out evaluations (and at the ends)
  int64_t eval_problems = 64;
  // Staleness bound (eta), in policy versions (optimizer updates): no sample made by weights
  // more than this many versions older than the ones being trained is trained on (each is
  // checked; one that would be is dropped and counted). 0 is synchronous mode: push, generate,
  // train. From 1 the next step's generation overlaps this step's training, and the weights
  // are pushed only as often as the bound needs (every step at 1, every other step at 2, ...).
  // The workers take new weights between requests only, so every token of a sample comes
  // from the sample's version.
  int64_t max_staleness = 0;
  // Routing replay (R3): the workers record the experts their router chose for every token,
  // and the trainer's forward and backward use those instead of its own router's top-k (the
  // router still learns through the gate weights), so a token's experts are the same in
  // rollout and training even where the two routers would pick differently.
  bool routing_replay = false;
  std::chrono::milliseconds timeout{120000};
  // Failure injection (tests): trainer rank 0 kills rollout worker `kill_worker`'s process
  // (SIGKILL; at TP 1) right after the weight update of RL step `kill_worker_after_sync`, before
  // it asks for that step's samples: the moment the servers' copy is the version the workers
  // hold, so a replacement heals from it. 0: never.
  int64_t kill_worker_after_sync = 0;
  int kill_worker = 1;
  // Checkpoints (rl/checkpoint.h) into `checkpoint_dir`/checkpoint-<RL step> every this many
  // RL steps (0: none); `resume` continues from one. `run`: the
  // options a resume must not change, by flag name.
  std::string checkpoint_dir;
  // rl_metrics.jsonl (rank 0): every step's record, appended and flushed as the step ends; a
  // resumed run writes the checkpoint's records first. Empty: none written.
  std::string metrics_path;
  int64_t checkpoint_every = 0;
  std::string resume;
  std::map<std::string, std::string> run;
  // Hears of a lost worker k's replacement joining (processes.json is rewritten then), and of
  // every event as it happens (on rank 0; a replacement rollout worker's says how it healed).
  std::function<void(int k)> on_rejoin;
  std::function<void(const RlEvent&)> on_event;
  // Asked between steps on rank 0 (`weightlift rl`: SIGTERM or SIGINT to the trainer): true
  // ends the run after the step it is in, as if --steps ended there: its records, summary and
  // policy are kept, the held-out set is evaluated, a checkpoint is written when checkpoints
  // are on (in the RL phase), and the workers are told to stop as at the end. Null: never.
  std::function<bool()> stop_requested;
};

// InvalidArgument naming the field when the trainer's and the workers' layouts cannot run
// `options`: a warm-start batch the trainer's ranks cannot share equally, or a TP the workers
// cannot split the model into (heads, kv heads, ffn rows, fp8's 128-wide blocks).
Status check_layouts(const RlOptions& options);

// ResourceExhausted with the estimate (model/memory_estimate.h) when a trainer rank or a
// rollout worker would need more memory than the budget allows for `options`: the policy and
// its optimizer, the logits of an RL step or of a rank's share of an SFT batch, the SFT
// batch's tokens, the KV cache of the most rows a worker generates at once (a step's, or every
// held-out problem's); InvalidArgument when the task's samples do not fit the model's
// positions. Cheap, and allocates nothing: every process checks it before connecting.
Status check_memory(const RlOptions& options);

// Rank 0 of the job, with `workers` rollout workers. `on_step` hears of every step. `store`
// is the job's: the trainer and each worker talk over a control channel of their own made
// through it, so a worker that dies is replaced by a new process of the same rank without the
// others reconnecting.
Result<RlSummary> run_trainer(const RlOptions& options, std::shared_ptr<comm::Store> store,
                              int workers, const std::function<void(const StepRecord&)>& on_step);
// Trainer rank `rank` in [1, options.trainers): takes every step rank 0 tells it to, until
// rank 0 says stop. A trainer rank cannot be replaced mid-run: losing one ends the run with
// an error (resume it from its last checkpoint).
Status run_trainer_rank(const RlOptions& options, std::shared_ptr<comm::Store> store, int rank,
                        int workers);
// Engine rank `rank` of rollout worker `worker` >= 1 (job rank trainers + (worker - 1) *
// engine_ranks() + rank), at the job's start or replacing a lost one (it heals its weights
// from a peer or the servers' copy and rejoins; engines of one rank only): serves until the
// trainer says stop. `joining`: a worker that joined the running job (below) under a number
// of its own.
Status run_rollout_worker(const RlOptions& options, const std::shared_ptr<comm::Store>& store,
                          int worker, int rank = 0, bool joining = false);
// A rollout worker of one process that joins a running job through its store (started with
// that store's address and the job's token in MASTER_ADDR, MASTER_PORT and
// WEIGHTLIFT_JOB_TOKEN, by hand or by a process manager; not by a launcher of its own, which
// sets its own): refused before anything connects, naming the option, unless it runs what the job
// runs (the model, the weights' format, sampling: protocol.h's job_identity); otherwise it takes
// the next worker number, heals to the current weights and is given prompts from the next request
// on, until the trainer says stop. It may leave at any time (stopped or lost): the trainer goes on
// with the others.
Status run_joining_worker(const RlOptions& options, const std::shared_ptr<comm::Store>& store);
// What run_joining_worker refuses before it reads the store: InvalidArgument naming the field.
Status check_joining(const RlOptions& options);

}  // namespace wl::rl
