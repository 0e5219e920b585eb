// The update round of update_round.h: places, the start handshake, the closing barrier.
#include "weightlift/transfer/modes/detail/update_round.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/timing.h"

namespace wl::transfer {
namespace {

// One rank's word at the start of an update.
enum RoundField { kRole, kEpoch, kVersion, kRefusal, kChecksums, kHost, kPid, kFields };

std::string receiver_name(int rank) { return "receiver rank " + std::to_string(rank); }

// The start words of every rank, as read by the checks below.
class StartWords {
 public:
  StartWords(std::vector<int64_t> words, int size) : words_(std::move(words)), size_(size) {}
  int64_t at(int rank, RoundField f) const { return words_[size_t(rank * kFields + f)]; }
  int size() const { return size_; }

 private:
  std::vector<int64_t> words_;
  int size_;
};

// This rank's start word; a receiver that holds a version opens the next slot first (a fresh
// one does so once the round's version is known).
std::vector<int64_t> my_start_word(int me, Receiver* receiver, Status* mine, const UpdateOptions& o,
                                   comm::Deadline deadline) {
  std::vector<int64_t> word(kFields, 0);
  word[kRole] = int64_t(receiver ? Role::kReceiver : Role::kTrainer);
  word[kChecksums] = o.checksums;
  const comm::ProcessId self = comm::this_process();
  word[kHost] = int64_t(self.host);
  word[kPid] = self.pid;
  if (receiver != nullptr) {
    word[kEpoch] = int64_t(receiver->epoch());
    word[kVersion] = int64_t(receiver->version());
    if (mine->ok() && receiver->version() > 0) {
      *mine = receiver->begin_write(int((receiver->version() + 1) % 2), deadline);
      if (!mine->ok()) *mine = mine->with_context(receiver_name(me));
    }
  }
  word[kRefusal] = int64_t(mine->code());
  return word;
}

// The same decision on every rank: who refused, who joined as what, stale epochs, versions.
Status check_start(const StartWords& w, const Plan& plan, int me, const Status& mine,
                   uint64_t* current) {
  for (int r = 0; r < w.size(); ++r) {
    if (w.at(r, kRefusal) != 0) {
      if (r == me) return mine;
      return Status(StatusCode(w.at(r, kRefusal)),
                    "update refused by world rank " + std::to_string(r) +
                        " (its own error says why); nothing was written");
    }
    if (w.at(r, kChecksums) != w.at(0, kChecksums)) {
      return failed_precondition("update: world ranks 0 and " + std::to_string(r) +
                                 " disagree on UpdateOptions::checksums; nothing was written");
    }
  }
  for (const PlanTrainer& t : plan.trainers) {
    if (t.rank >= w.size() || w.at(t.rank, kRole) != int64_t(Role::kTrainer)) {
      return failed_precondition("update: world rank " + std::to_string(t.rank) +
                                 " is a trainer in the plan but did not join as one");
    }
  }
  *current = 0;
  for (const PlanReceiver& r : plan.receivers) {
    const std::string who = receiver_name(r.rank);
    if (r.rank >= w.size() || w.at(r.rank, kRole) != int64_t(Role::kReceiver)) {
      return failed_precondition("update: " + who + " is in the plan but did not join as one");
    }
    const uint64_t epoch = uint64_t(w.at(r.rank, kEpoch));
    if (epoch != r.epoch) {
      return failed_precondition(
          "update: " + who + ": stale rkey: the plan was made for its epoch " + hex_word(r.epoch) +
          " but it now runs epoch " + hex_word(epoch) +
          " (it restarted); gather metadata and plan again. Nothing was written");
    }
    *current = std::max(*current, uint64_t(w.at(r.rank, kVersion)));
  }
  // Receivers hold the newest version among them, 0 (fresh), or one an even number behind.
  for (const PlanReceiver& r : plan.receivers) {
    const uint64_t v = uint64_t(w.at(r.rank, kVersion));
    if (!can_take_next_version(v, *current)) {
      return failed_precondition("update: " + receiver_name(r.rank) + " holds version " +
                                 std::to_string(v) + ", an odd number behind the current " +
                                 std::to_string(*current) + ": version " +
                                 std::to_string(*current + 1) +
                                 " would go into the slot its readers use; nothing was written");
    }
  }
  return ok_status();
}

Result<RoundStart> start_round(comm::Group& world, const Plan& plan, Receiver* receiver,
                               Status mine, const UpdateOptions& o, comm::Deadline deadline) {
  const int me = world.rank();
  const std::vector<int64_t> word = my_start_word(me, receiver, &mine, o, deadline);
  std::vector<int64_t> words(size_t(world.size() * kFields));
  WL_RETURN_IF_ERROR(comm::allgather(world, {.send = word.data(),
                                             .recv = words.data(),
                                             .count = kFields,
                                             .dtype = DType::kI64,
                                             .timeout = o.timeout}));
  const StartWords w(std::move(words), world.size());
  uint64_t current = 0;
  WL_RETURN_IF_ERROR(check_start(w, plan, me, mine, &current));
  RoundStart round;
  round.version = current + 1;
  round.slot = int(round.version % 2);
  for (int r = 0; r < world.size(); ++r) {
    round.processes.push_back({uint64_t(w.at(r, kHost)), w.at(r, kPid)});
  }
  if (receiver != nullptr && receiver->version() == 0) {
    round.fresh_write = receiver->begin_write(round.slot, deadline);
  }
  return round;
}

// User tag of the closing barrier's words (p2p.cc's checksums are 0x7c5, naive.cc's 0x7c6-7).
constexpr uint32_t kFinishTag = 0x7c8;

// A rank's failure as a barrier word: the largest names one failing rank and its code.
int64_t failure_word(StatusCode code, int rank) { return (int64_t(code) << 32) | (rank + 1); }

// One barrier word to or from `peer`, posted; the wait's deadline bounds it.
Result<comm::Request> start_word(comm::Group& world, bool send, int peer, int64_t* word) {
  return send ? world.start_send({.data = word, .bytes = 8, .peer = peer, .tag = kFinishTag})
              : world.start_recv({.data = word, .bytes = 8, .peer = peer, .tag = kFinishTag});
}

// Waits on `q` and its peer alone: a failure elsewhere in the world (another receiver dead)
// is not this exchange's.
Status wait_word(comm::Group& world, Result<comm::Request>& q, comm::Deadline deadline) {
  if (!q.ok()) return q.status();
  return world.wait_all_watching(std::span(&*q, 1), {}, deadline);
}

// Rank 0's side of the closing barrier: every other rank's word, then the largest to each.
// A rank that cannot be heard counts as failed with the error of that wait (`unheard`). A rank
// the result cannot reach is not waited for past the deadline: it stays on its version, as a
// rank that died after its word would, and the next update finds it behind.
int64_t gather_and_tell(comm::Group& world, int64_t mine, comm::Deadline deadline,
                        Status* unheard) {
  const int size = world.size();
  std::vector<int64_t> words(size_t(size), 0);
  std::vector<Result<comm::Request>> recvs;
  for (int r = 1; r < size; ++r) recvs.push_back(start_word(world, false, r, &words[size_t(r)]));
  for (int r = 1; r < size; ++r) {
    const Status got = wait_word(world, recvs[size_t(r - 1)], deadline);
    if (got.ok()) continue;
    words[size_t(r)] = failure_word(got.code(), r);
    if (unheard->ok()) *unheard = got.with_context("closing the update round");
  }
  int64_t result = std::max(mine, *std::max_element(words.begin(), words.end()));
  // Posted to every rank before any is waited for: a rank gone after its word holds no one
  // else's result back. One the result cannot reach stays on its version.
  std::vector<Result<comm::Request>> sends;
  for (int r = 1; r < size; ++r) sends.push_back(start_word(world, true, r, &result));
  for (Result<comm::Request>& q : sends) {
    const Status told = wait_word(world, q, deadline);
    (void)told;
  }
  return result;
}

// The closing barrier. Each rank contributes its failure as (code << 32) | (rank + 1), so the
// maximum names one failing rank and its error's code on every rank. A star through world
// rank 0 rather than an allreduce: rank 0 decides once every word is in, and each rank hears
// the decision from rank 0 alone. In an allreduce among ranks that exchange with each other
// (recursive doubling), a rank that dies after giving its word can leave a healthy rank
// waiting on it while rank 0 already returned success: the servers then count a receiver as
// updated that never published (seen on the testbed, a host's link cut mid-update).
Status finish_round(comm::Group& world, Receiver* receiver, const RoundStart& round,
                    const Status& failed_here, std::chrono::milliseconds timeout) {
  const Status failed = failed_here.ok() ? round.fresh_write : failed_here;
  const comm::Deadline deadline = world.deadline(timeout);  // 0: the group's own timeout
  int64_t who = failed.ok() ? 0 : failure_word(failed.code(), world.rank());
  Status unheard;
  if (world.rank() == 0) {
    who = gather_and_tell(world, who, deadline, &unheard);
  } else {
    for (bool send : {true, false}) {
      Result<comm::Request> q = start_word(world, send, 0, &who);
      WL_RETURN_IF_ERROR(wait_word(world, q, deadline).with_context("closing the update round"));
    }
  }
  if (!failed.ok()) return failed;
  if (who != 0) {
    if (!unheard.ok()) return unheard;
    return Status(StatusCode(who >> 32),
                  "update to version " + std::to_string(round.version) + ": world rank " +
                      std::to_string((who & 0xffffffff) - 1) +
                      " failed (its own error, or world rank 0's wait for it, says why); every "
                      "receiver stays on version " +
                      std::to_string(round.version - 1));
  }
  if (receiver != nullptr) receiver->publish(round.slot, round.version);
  return ok_status();
}

}  // namespace

Result<const PlanTrainer*> place_trainer(const Plan& plan, int rank,
                                         const TrainerWeights& weights) {
  const std::string who = "trainer rank " + std::to_string(rank);
  const PlanTrainer* pt = plan.find_trainer(rank);
  if (pt == nullptr) return invalid_argument(who + ": not a trainer of this transfer plan");
  if (pt->mesh_id != weights.mesh_id() || pt->mesh_rank != weights.mesh_rank() ||
      plan.mesh_size != weights.mesh_size()) {
    return invalid_argument(
        who + ": the plan puts it at mesh " + std::to_string(pt->mesh_id) + " rank " +
        std::to_string(pt->mesh_rank) + " of " + std::to_string(plan.mesh_size) +
        ", its weights are at mesh " + std::to_string(weights.mesh_id()) + " rank " +
        std::to_string(weights.mesh_rank()) + " of " + std::to_string(weights.mesh_size()));
  }
  // A plan made from other trainers' metadata may place the same seat over other rows (a
  // pipeline stage's layers instead of torch.chunk's rows): every piece it sends from its own
  // shards must be in them.
  for (const PlanTask& t : plan.tasks) {
    if (t.sender != rank) continue;
    for (const PlanPiece& p : t.pieces) {
      const ShardedTensor* s = weights.find(p.param);
      if (s == nullptr || !s->local_rows().contains(p.row_begin, p.row_end)) {
        return invalid_argument(who + ": the plan sends rows [" + std::to_string(p.row_begin) +
                                ", " + std::to_string(p.row_end) + ") of '" + p.param +
                                "' from it, which its weights do not hold (a plan made for "
                                "other trainers; plan again from their metadata)");
      }
    }
  }
  return pt;
}

Result<const PlanReceiver*> place_receiver(const Plan& plan, int rank) {
  const PlanReceiver* pr = plan.find_receiver(rank);
  if (pr == nullptr) {
    return invalid_argument(receiver_name(rank) + ": not a receiver of this transfer plan");
  }
  return pr;
}

Result<UpdateReport> run_round(
    comm::Group& world, const Plan& plan, Receiver* receiver, TransferMode mode,
    const UpdateOptions& o, Status mine,
    const std::function<Status(const RoundStart&, UpdateReport&)>& body) {
  const Stopwatch total;
  UpdateReport report;
  report.watermark_bytes = o.watermark_bytes;
  if (mode != TransferMode::kP2P && (o.checksums || o.staging_hook)) {
    mine = invalid_argument("world rank " + std::to_string(world.rank()) + ": " +
                            std::string(transfer_mode_name(mode)) +
                            " mode has no per-task checksums or staging hook (p2p's)");
  }
  WL_ASSIGN_OR_RETURN(RoundStart round,
                      start_round(world, plan, receiver, mine, o, world.deadline(o.timeout)));
  report.version = round.version;
  report.barrier_seconds += total.seconds();
  const Status failed = body(round, report);
  const Stopwatch barrier;
  WL_RETURN_IF_ERROR(finish_round(world, receiver, round, failed, o.timeout));
  report.barrier_seconds += barrier.seconds();
  report.total_seconds = total.seconds();
  return report;
}

}  // namespace wl::transfer
