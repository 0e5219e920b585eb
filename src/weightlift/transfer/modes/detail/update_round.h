// The versioned frame every update of the broadcast and naive modes runs in; the same rules
// as the p2p executor's (modes/p2p.h, steps 1 and 4), without rkeys or per-task checksums.
//
//   start   each receiver waits until no reader holds the slot version v+1 will use; every
//           rank allgathers (role, version, refusal); a refusal anywhere, a rank that did not
//           join in its planned role, or receivers on different versions refuse the update on
//           every rank before any byte moves. A fresh receiver (version 0: it has just
//           started and had no peer to heal from) joins whatever version the others hold; it
//           learns which slot to clear for writing from the allgather.
//   finish  an allreduce of "who failed" over the world: the global barrier. Only if nobody
//           failed does each receiver publish v+1; otherwise receivers stay on v.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string_view>

#include "weightlift/comm/group.h"
#include "weightlift/transfer/modes/p2p.h"
#include "weightlift/transfer/plan/planner.h"
#include "weightlift/transfer/layout/receiver.h"
#include "weightlift/transfer/layout/trainer_weights.h"

namespace wl::transfer {

// Collective over `world`, once when a mode's executor is made: every rank learns the shard
// dtype the trainers hold (`weights`: null on receivers) and checks that every rank passed
// the same `setting` (a mode option such as bucket_bytes, named `what`). FailedPrecondition
// if trainers hold different dtypes or ranks differ on the setting.
Result<DType> agree_on_shard_dtype(comm::Group& world, const TrainerWeights* weights,
                                   int64_t setting, std::string_view what);

// This rank's entry in the plan, checked against where its weights sit (mesh, mesh rank, mesh
// size). InvalidArgument naming the rank and both positions otherwise. Shared by every mode.
Result<const PlanTrainer*> place_trainer(const Plan& plan, int rank, const TrainerWeights& weights);
// InvalidArgument unless the plan has `rank` as a receiver.
Result<const PlanReceiver*> place_receiver(const Plan& plan, int rank);

struct RoundStart {
  uint64_t version = 0;  // the version this update makes
  int slot = 0;          // where receivers write it: version % 2
  Status fresh_write;    // a fresh receiver's begin_write, made once the version was known
};

// Collective over `world`. `receiver`: null on trainers. `mine`: this rank's own refusal.
Result<RoundStart> start_round(comm::Group& world, const Plan& plan, Receiver* receiver,
                               Status mine, comm::Deadline deadline,
                               std::chrono::milliseconds timeout);

// Receivers hold `current` (the newest among them) or 0 (fresh); FailedPrecondition naming
// the first that holds another. Shared with the p2p executor.
Status check_receiver_versions(const Plan& plan, const std::function<uint64_t(int)>& version_of,
                               uint64_t current);

// Collective over `world`; `failed` is this rank's failure during the update (OK if none).
// Publishes on success; returns this rank's failure or names the rank that failed.
Status finish_round(comm::Group& world, Receiver* receiver, const RoundStart& round,
                    const Status& failed, std::chrono::milliseconds timeout);

// One whole update of a mode other than p2p (`mode` names it in errors), collective over
// `world`: refuses p2p's per-task checksums and staging hook, and `mine` (this rank's own
// refusal, such as a watermark too small), on every rank before any byte moves; starts the
// round; runs `body`, this rank's part; finishes the round. Fills the report's version,
// watermark, barrier and total times; `body` fills the rest.
Result<UpdateReport> run_round(comm::Group& world, const Plan& plan, Receiver* receiver,
                               const UpdateOptions& options, std::string_view mode, Status mine,
                               const std::function<Status(const RoundStart&, UpdateReport&)>& body);

}  // namespace wl::transfer
