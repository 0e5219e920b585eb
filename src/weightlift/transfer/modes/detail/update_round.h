// The versioned round every update runs in, whatever the mode (update_executor.h):
//
//   start   each receiver that holds version v waits until no reader holds the slot v + 1 will
//           use and opens it for writing; every rank allgathers (role, epoch, version, refusal,
//           checksums, host, pid). Every rank then makes the same decision: a refusal anywhere
//           (a watermark too small, p2p's options given to another mode, a slot still read), a
//           rank that did not join in its planned role, a receiver whose epoch differs from
//           the plan's (it restarted since planning: p2p's rkey for it is stale), ranks that
//           disagree on checksums, or receivers on different versions refuse the update on
//           every rank before any byte moves. A fresh receiver (version 0: it started and could
//           heal neither from a peer nor from the servers, fleet/) takes the others' next
//           version; it opens that slot once the allgather has told it which.
//   body    the mode's own part (p2p.h, broadcast.h, naive.h).
//   finish  "who failed, and how" from every rank to world rank 0, and rank 0's verdict back to
//           each: the global barrier, a star so that each rank hears the verdict from rank 0
//           alone (a rank that dies after its word holds no other rank back). Only if nobody
//           failed does each receiver publish v + 1; otherwise every receiver stays on v, the
//           failing rank returns its own error and the others an error of the same code that
//           names it. A rank the verdict cannot reach stays on v, as one that died would.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/core/checksum.h"
#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

// A 64-bit word (an epoch, a checksum) as errors print it: 0x and 16 hex digits.
inline std::string hex_word(uint64_t v) { return "0x" + checksum_hex(v); }

// This rank's entry in the plan, checked against where its weights sit (mesh, mesh rank, mesh
// size) and against the rows they hold (every piece it sends from its own shards). InvalidArgument
// naming the rank and both positions, or the rows, otherwise.
Result<const PlanTrainer*> place_trainer(const Plan& plan, int rank, const TrainerWeights& weights);
// InvalidArgument unless the plan has `rank` as a receiver.
Result<const PlanReceiver*> place_receiver(const Plan& plan, int rank);

struct RoundStart {
  uint64_t version = 0;  // the version this update makes
  int slot = 0;          // where receivers write it: version % 2
  Status fresh_write;    // a fresh receiver's opening of that slot, made once it was known
  std::vector<comm::ProcessId> processes;  // every world rank's process, by rank
};

// One whole update, collective over `world`: starts the round (refusing `mine`, this rank's
// own objection, and for modes other than p2p its checksums and staging hook, on every rank),
// runs `body` (this rank's part, which fills the report's work fields), finishes the round.
// Fills the report's version, watermark, barrier and total times.
Result<UpdateReport> run_round(comm::Group& world, const Plan& plan, Receiver* receiver,
                               TransferMode mode, const UpdateOptions& options, Status mine,
                               const std::function<Status(const RoundStart&, UpdateReport&)>& body);

}  // namespace wl::transfer
