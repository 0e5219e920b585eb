// The executor, p2p mode: replays a plan after each training step, every receiver getting
// exactly its own bytes by one-sided puts straight into its registered weight slot.
//
// One update, collective over the world group (trainers and receivers alike):
//   1. start      receivers wait until no reader holds the slot version v+1 will use; every
//                 rank allgathers (role, epoch, version, refusal, options). Every rank then
//                 makes the same decision: a receiver whose epoch differs from the plan's
//                 (it restarted: its rkey is stale), a watermark below what this plan needs,
//                 mismatched options, or receivers on different versions refuse the update
//                 on every rank before any put. A fresh receiver (version 0: it started and
//                 could not heal, fleet/heal_from_peer.h and fleet/heal_from_servers.h) takes the others' next version;
//                 it clears its slot for writing once the start tells it which
//                 (modes/detail/update_round.h).
//   2. per sender, its tasks through seed 000's stages, as a queue:
//        load     offloaded shards: the rows a task reads copied out of the offload buffer
//        prepare  full_tensor() where the plan says (all ranks of the mesh, in plan order),
//                 then slice, fuse, cast or fp8-quantize into a staging buffer (modes/detail/prepare.h)
//        write    one-sided put(s) into the receiver's slot for version v+1; not waited for,
//                 so the next task is prepared while this one is on the wire. When the
//                 receiver's slots are in shared memory this process can map (same host:
//                 UCX's rkey_ptr, as comm's shared-memory collectives use), the write is a
//                 store through that mapping instead, and prepare writes its output there
//                 directly: one copy per byte, no staging, no puts. (UCX 1.13 leaves CMA out
//                 of endpoints with peer error handling, so a put on one host is emulated
//                 with 8 KiB active messages: two copies, the second by the receiver.)
//        complete puts are retired oldest first when staging would pass the watermark, then
//                 all of them, then a flush per receiver
//      Staging bytes (loads, f32 scratch, staged outputs and gathered full tensors) never pass
//      the watermark: a task starts only when it fits beside what is in flight.
//      bf16 tasks that read one contiguous bf16 shard range need no staging: they are put
//      (or copied into the mapping) straight from the shard (zero copy).
//   3. checksums  (optional) each sender sends each receiver one 64-bit checksum per task;
//                 the receiver verifies what landed in its slot.
//   4. barrier    an allreduce of "who failed" over the world: the global barrier. Only if
//                 every receiver verified does every receiver publish version v+1 (layout/receiver.h);
//                 otherwise every rank returns the same error and receivers stay on v.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "weightlift/comm/group.h"
#include "weightlift/transfer/plan/planner.h"
#include "weightlift/transfer/layout/receiver.h"
#include "weightlift/transfer/layout/trainer_weights.h"

namespace wl::transfer {

struct UpdateOptions {
  // Bytes of staging a sender may hold at once: the seed's max_tmp_bytes. Must be at least
  // required_watermark(); an update with less is refused before any byte moves.
  size_t watermark_bytes = size_t(256) << 20;
  // Per-task checksums verified by the receivers; costs one pass over the bytes on each side.
  bool checksums = false;
  std::chrono::milliseconds timeout{0};  // every wait in the update; 0: the group's default
  // Tests only: called on every staged task after its checksum is taken and before its put,
  // with the staged bytes (data, then the fp8 scale row). Changing them simulates corruption
  // on the wire. Not called for zero-copy tasks.
  std::function<void(const PlanTask&, std::span<std::byte>)> staging_hook;
  // Store straight into receivers whose slots this process can map (see the top). With
  // checksums or a staging hook, tasks are still staged first (the checksum is of what was
  // meant to land) and then copied through the mapping. False: always put.
  bool direct_stores = true;
};

struct UpdateReport {
  uint64_t version = 0;         // the version receivers hold after this update
  uint64_t tasks = 0;           // this rank's tasks (sent or received)
  uint64_t gathers = 0;         // full_tensor() calls this rank took part in
  uint64_t bytes = 0;           // bytes sent (trainer) or received (receiver), as planned
  size_t peak_staging_bytes = 0;
  size_t watermark_bytes = 0;
  double gather_seconds = 0;    // full_tensor()
  double prepare_seconds = 0;   // load, slice, fuse, cast, quantize, checksum; with direct
                                // stores this includes writing the output into the slot
  double write_seconds = 0;     // issuing puts, waiting for them, flush; copies into mapped
                                // slots of what was staged or zero copy
  uint64_t direct_bytes = 0;    // of `bytes`, those stored through a mapping (no put)
  double barrier_seconds = 0;   // start, checksum exchange, final barrier
  double total_seconds = 0;
};

class Executor {
 public:
  // Connects to every receiver this trainer writes to and unpacks their rkeys.
  // InvalidArgument if this rank is not a trainer of the plan or its mesh position differs.
  static Result<std::unique_ptr<Executor>> for_trainer(std::shared_ptr<comm::Group> world,
                                                       Plan plan, TrainerWeights& weights);
  static Result<std::unique_ptr<Executor>> for_receiver(std::shared_ptr<comm::Group> world,
                                                        Plan plan, Receiver& receiver);
  ~Executor();

  // Collective over the world group.
  Result<UpdateReport> update(const UpdateOptions& options);

  // The smallest watermark this rank can run the plan with (0 on receivers): the largest
  // task's staging beside the full tensors gathered for it.
  size_t required_watermark() const;
  const Plan& plan() const;

  struct Impl;

 private:
  explicit Executor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wl::transfer
