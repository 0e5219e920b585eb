// UpdateExecutor: one weight update after each training step, replayed from a plan, whichever
// way the bytes travel. Three modes sit behind it:
//
//   p2p        each receiver gets exactly its own bytes, fused, sliced, cast or quantized on
//              the trainers, by one-sided puts into its slot (p2p.h; seed 000)
//   broadcast  checkpoint-engine's update: the state dict in buckets, each broadcast to every
//              receiver, which converts its own part (broadcast.h; seed 002)
//   naive      the simple baseline: one trainer gathers the state dict, serialises it and sends
//              it to each receiver in turn (naive.h)
//
// Every mode runs the same versioned round (detail/update_round.h): receivers hold version v
// in one of two slots (layout/receiver.h) and version v + 1 is written into the other, then
// published on every receiver only after a global barrier that found no failure anywhere. So
// an update that fails leaves every receiver on v, and no reader ever sees a mixture.
//
//   WL_ASSIGN_OR_RETURN(auto ex, make_update_executor({.world = world, .plan = plan,
//                                                      .weights = &weights,
//                                                      .mode = TransferMode::kP2P}));
//   for (...) { train_step(); WL_ASSIGN_OR_RETURN(UpdateReport r, ex->update({})); }
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>

#include "weightlift/comm/group/group.h"
#include "weightlift/transfer/layout/receiver.h"
#include "weightlift/transfer/layout/trainer_weights.h"
#include "weightlift/transfer/plan/planner.h"

namespace wl::transfer {

enum class TransferMode : uint8_t { kP2P, kBroadcast, kNaive };

// Whether a receiver holding version `held` can take the update from `current` (the newest
// any receiver of the update holds) to current + 1: it holds `current`, nothing yet (0), or a
// version behind it by an even number (it missed updates: its host was cut off, say). Every
// update moves every byte, so only the slot matters: version current + 1 goes into slot
// (current + 1) % 2, the one such a receiver does not serve from. One behind by an odd number
// serves from that slot; it can take the update after.
constexpr bool can_take_next_version(uint64_t held, uint64_t current) {
  return held == 0 || (held <= current && (current - held) % 2 == 0);
}
std::string_view transfer_mode_name(TransferMode mode);  // "p2p", "broadcast", "naive"
std::optional<TransferMode> transfer_mode_from_name(std::string_view name);

struct UpdateOptions {
  // Bytes of staging a sender may hold at once: the seed's max_tmp_bytes. Must be at least
  // required_watermark(); an update with less is refused before any byte moves.
  size_t watermark_bytes = size_t(256) << 20;
  // p2p only: per-task checksums verified by the receivers; costs one pass over the bytes on
  // each side. The other modes refuse it rather than ignore it.
  bool checksums = false;
  std::chrono::milliseconds timeout{0};  // every wait in the update; 0: the group's default
  // p2p tests only: called on every staged task after its checksum is taken and before its
  // put, with the staged bytes (data, then the fp8 scale row). Changing them simulates
  // corruption on the wire. Not called for zero-copy tasks; refused by the other modes.
  std::function<void(const PlanTask&, std::span<std::byte>)> staging_hook;
  // p2p: store straight into receivers whose slots this process can map (p2p.h). With
  // checksums or a staging hook, tasks are still staged first (the checksum is of what was
  // meant to land) and then copied through the mapping. False: always put.
  bool direct_stores = true;
};

// One rank's part of an update. Times are seconds of wall time on this rank.
struct UpdateReport {
  uint64_t version = 0;  // the weight version receivers hold after this update
  uint64_t tasks = 0;    // this rank's tasks (sent or received)
  uint64_t gathers = 0;  // full_tensor() calls this rank took part in
  uint64_t bytes = 0;    // bytes sent (trainer) or received (receiver)
  size_t peak_staging_bytes = 0;
  size_t watermark_bytes = 0;
  double gather_seconds = 0;   // full_tensor()
  double prepare_seconds = 0;  // load, slice, fuse, cast, quantize, checksum; receivers of
                               // broadcast and naive: converting into the slot. p2p with
                               // direct stores: this includes writing into the slot
  double write_seconds = 0;    // puts, broadcasts or sends and waiting for them; copies into
                               // mapped slots of what was staged
  uint64_t direct_bytes = 0;   // p2p: of `bytes`, those stored through a mapping (no put)
  double barrier_seconds = 0;  // the round's start and its closing barrier
  double total_seconds = 0;
};

class UpdateExecutor {
 public:
  virtual ~UpdateExecutor() = default;

  // Collective over the world group: every rank of the plan calls it, with the same checksums
  // setting. Returns this rank's report, or the reason the update failed (on every rank:
  // the failing rank's own error, the others an error naming it).
  virtual Result<UpdateReport> update(const UpdateOptions& options) = 0;

  // The smallest watermark this rank can run the plan with (0 where nothing is staged).
  virtual size_t required_watermark() const = 0;
  virtual const Plan& plan() const = 0;
};

struct ExecutorOptions {
  std::shared_ptr<comm::Group> world;  // every trainer and receiver of the plan
  Plan plan;                           // the same plan on every rank (plan/plan_transfer.h)
  TrainerWeights* weights = nullptr;   // this rank is a trainer: its weights (borrowed), or
  Receiver* receiver = nullptr;        // this rank is a receiver: its receiver (borrowed)
  TransferMode mode = TransferMode::kP2P;
  size_t bucket_bytes = size_t(64) << 20;  // broadcast: bytes per bucket (raised to the
                                           // largest group of parameters read together)
};

// Collective over the world group (the modes split groups and agree on the trainers' shard
// dtype here). InvalidArgument unless exactly one of weights and receiver is set, or if the
// plan puts this rank elsewhere (naming both positions); FailedPrecondition if ranks disagree
// on the mode's settings or the trainers on their shard dtype.
Result<std::unique_ptr<UpdateExecutor>> make_update_executor(ExecutorOptions options);

}  // namespace wl::transfer
