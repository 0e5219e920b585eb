// Training on a pipeline that survives the loss of a stage: `weightlift train --pp S
// --recovery ...` under `weightlift launch -n S --restart-failed K`, one process per block
// stage (the first holding the embedding too, the last the norm and head).
//
// Every process runs the same loop as parallel/run/trainer.h's (the same data, schedule, metrics,
// validation and checkpoints), with a step of routed_step.h (CheckFree+'s swapped routes,
// each stage clipped and stepped on its own, as the paper's code trains) and these additions:
//
//   losing a stage  A process that dies (SIGKILL, a lost machine) breaks its connections;
//                   the others' waits fail within the transport's keepalive, a silent one's at
//                   the deadline. The survivors settle through the store which stages are gone
//                   and where the run stands (membership.h), connect a new epoch with the
//                   replacements, bring the lost stages back by the strategy (recovery.h), and
//                   go on with the next step. A replacement is the same command started again
//                   (the launcher's --restart-failed, or by hand with the same variables): it
//                   learns from the store that it replaces a lost process.
//   strategies      checkfree: the lost block stage becomes its neighbours' average weighted by
//                   their last post-clip gradient norms, with a fresh AdamW and lr x lr_scale.
//                   checkfree+: every other micro-batch swapped; stages 0/1 and S-2/S-1 come
//                   back as copies of their partners, the embedding and the head from their
//                   replicas, exactly. checkpoint: every process rolls back to the newest
//                   checkpoint (weights, moments, data position). none: fresh random weights.
//   fallbacks       What the strategy cannot rebuild rolls the run back to the newest
//                   checkpoint (or to its start without one), and the record says why: under
//                   checkfree the first and last stages, which hold the embedding and the head
//                   (the paper's Table 1: no recovery of the ends); under checkfree+ an end lost
//                   together with its replica's holder; every stage at once.
//   failures        --fail-prob p: at the start of each iteration every stage's process is
//                   lost with probability p (failure_schedule.h, the same draws for every
//                   strategy and for the simulation), killing itself with SIGKILL; --kill-at
//                   names some by hand. An iteration is a step of wall-clock: a rollback's
//                   repeated steps count again.
//
// What a run leaves besides train()'s outputs: summary.json (every recovery: iteration, the
// stages and how each came back, detection to the first step of the new stage, the loss before
// and after; the final validation loss) and processes.json, rewritten whenever a process is
// replaced. Both by the first stage's process, docs/formats.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "weightlift/comm/store/store.h"
#include "weightlift/comm/transport/transport.h"
#include "weightlift/core/status.h"
#include "weightlift/fault/failure_schedule.h"
#include "weightlift/fault/recovery.h"
#include "weightlift/parallel/run/trainer.h"

namespace wl::fault {

struct ResilienceOptions {
  Recovery recovery = Recovery::kCheckFree;
  double lr_scale = 1.1;  // a rebuilt stage's learning-rate factor
  double fail_prob = 0;   // of each stage's process, at the start of each iteration
  uint64_t fail_seed = 1;
  std::vector<ScheduledLoss> kills;  // stages lost at given iterations, by hand
  // Stages whose process stops (SIGSTOP) at the start of given iterations, as a hung machine
  // does: alive to the transport, silent to the others, which declare it gone at the deadline.
  std::vector<ScheduledLoss> freezes;
  // How often a peer that stopped answering is probed: it bounds how soon a dead stage is
  // noticed (comm/transport/transport.h).
  std::chrono::milliseconds keepalive{200};
  // A directory: each stage a recovery rebuilds from its neighbours (average, copy or fresh)
  // writes its blocks' weights as they came back, before its first step, as
  // `stage-S-iteration-I.safetensors` (one f32 tensor "blocks": the stage's block units'
  // parameters in ParamLayout order; metadata "how", "from" and the neighbours' "norms"), so
  // that a drill can hold the rebuild to its rule. Empty: none.
  std::string rebuild_dump;
};

// One loss and its recovery, as summary.json records it.
struct RecoveryRecord {
  int64_t iteration = 0;        // the iteration the loss was found in
  int64_t epoch = 0;            // the epoch it ended
  std::vector<Rebuild> plan;    // per lost stage: how it came back
  std::string fallback;         // why the strategy's own rule gave way to a rollback; "" none
  int64_t step = 0;             // the run went on after this step
  int64_t rolled_back_to = -1;  // the step a rollback went back to; -1 none
  std::string checkpoint;       // ... from this checkpoint ("" : the run's start)
  double detection_ms = -1;     // a loss the schedule caused: its kill to the first survivor
                                // noticing it; -1 when the kill time is not known
  double recovery_ms = 0;       // the first survivor noticing it to the first step of the new
                                // epoch (the rebuilt stage's first step) starting
  double loss_before = 0;       // the last step's loss before the loss (NaN: none)
  double loss_after = 0;        // the first step's after it
};

struct Summary {
  parallel::TrainSummary train;
  int64_t iterations = 0;
  std::vector<RecoveryRecord> recoveries;
};

struct Hooks {
  // As parallel::TrainOptions' on_ready and on_step (the options' own are not used).
  std::function<Status()> on_ready;
  std::function<void(const train::StepMetrics&)> on_step;
  // The first stage's process, once a recovery's first step has run (also what summary.json
  // holds), and any process for what it did to a silent peer.
  std::function<void(const RecoveryRecord&)> on_recovery;
  std::function<void(const std::string&)> on_notice;
};

// InvalidArgument naming the field for a layout the strategy cannot run on: dp, `tp` or `ep`
// above 1, a `dp_mode` other than ddp, tied embeddings, f16, stages that do not divide the
// layers, fewer stages than the strategy needs (check_recovery_layout), an odd number of
// micro-batches under checkfree+, a failure probability outside [0, 1], a kill outside the
// stages.
Status check_resilient_layout(const parallel::TrainOptions& options, const ResilienceOptions& r,
                              const model::ModelConfig& config);

// Stage `stage` of `stages` (one process each), the job's store shared by all of them and by
// their replacements. Returns once the run has finished, or with the error that stopped it.
Result<Summary> train(const parallel::TrainOptions& options, const ResilienceOptions& resilience,
                      std::shared_ptr<comm::Store> store, int stage, int stages,
                      const Hooks& hooks);

// A checkpoint's per-stage optimizer groups (fault.json beside state.json): what a rebuilt
// stage's fresh AdamW and learning-rate factor need to survive a resume or a rollback.
inline constexpr const char* kGroupsFile = "fault.json";

}  // namespace wl::fault
