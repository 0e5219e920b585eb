// The update frame of modes/detail/update_round.h: places, start_round, finish_round, run_round.
#include "weightlift/transfer/modes/detail/update_round.h"

#include <algorithm>

#include <string>
#include <vector>

#include "weightlift/comm/allgather.h"
#include "weightlift/comm/allreduce.h"

namespace wl::transfer {
namespace {
enum Field { kRole, kVersion, kRefusal, kFields };
}  // namespace

Result<DType> agree_on_shard_dtype(comm::Group& world, const TrainerWeights* weights,
                                   int64_t setting, std::string_view what) {
  // Per rank: the shard dtype + 1 (0 on receivers), then the setting.
  const int64_t word[2] = {weights ? int64_t(weights->options().dtype) + 1 : 0, setting};
  std::vector<int64_t> words(size_t(world.size()) * 2);
  WL_RETURN_IF_ERROR(comm::allgather(
      world, {.send = word, .recv = words.data(), .count = 2, .dtype = DType::kI64}));
  int64_t dtype = 0;
  for (int r = 0; r < world.size(); ++r) {
    const int64_t d = words[size_t(r) * 2], s = words[size_t(r) * 2 + 1];
    if (s != words[1]) {
      return failed_precondition("world ranks 0 and " + std::to_string(r) + " disagree on " +
                                 std::string(what) + " (" + std::to_string(words[1]) + " and " +
                                 std::to_string(s) + ")");
    }
    if (d == 0) continue;
    if (dtype != 0 && d != dtype) {
      return failed_precondition("trainers hold shards of different dtypes (" +
                                 std::string(dtype_name(DType(dtype - 1))) + " and " +
                                 std::string(dtype_name(DType(d - 1))) + " at world rank " +
                                 std::to_string(r) + ")");
    }
    dtype = d;
  }
  if (dtype == 0) return failed_precondition("no trainer joined the transfer");
  return DType(dtype - 1);
}

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
  return pt;
}

Result<const PlanReceiver*> place_receiver(const Plan& plan, int rank) {
  const PlanReceiver* pr = plan.find_receiver(rank);
  if (pr == nullptr) {
    return invalid_argument("receiver rank " + std::to_string(rank) +
                            ": not a receiver of this transfer plan");
  }
  return pr;
}

Result<RoundStart> start_round(comm::Group& world, const Plan& plan, Receiver* receiver,
                               Status mine, comm::Deadline deadline,
                               std::chrono::milliseconds timeout) {
  const int me = world.rank();
  int64_t word[kFields] = {};
  word[kRole] = int64_t(receiver ? Role::kReceiver : Role::kTrainer);
  if (receiver != nullptr) {
    word[kVersion] = int64_t(receiver->version());
    if (mine.ok() && receiver->version() > 0) {
      mine = receiver->begin_write(int((receiver->version() + 1) % 2), deadline);
      if (!mine.ok()) mine = mine.with_context("receiver rank " + std::to_string(me));
    }
  }
  word[kRefusal] = int64_t(mine.code());
  std::vector<int64_t> words(size_t(world.size() * kFields));
  WL_RETURN_IF_ERROR(comm::allgather(world, {.send = word,
                                             .recv = words.data(),
                                             .count = kFields,
                                             .dtype = DType::kI64,
                                             .timeout = timeout}));
  auto at = [&](int rank, int field) { return words[size_t(rank * kFields + field)]; };
  for (int r = 0; r < world.size(); ++r) {
    if (at(r, kRefusal) == 0) continue;
    if (r == me) return mine;
    return Status(StatusCode(at(r, kRefusal)),
                  "update refused by world rank " + std::to_string(r) +
                      " (its own error says why); nothing was written");
  }
  for (const PlanTrainer& t : plan.trainers) {
    if (t.rank >= world.size() || at(t.rank, kRole) != int64_t(Role::kTrainer)) {
      return failed_precondition("update: world rank " + std::to_string(t.rank) +
                                 " is a trainer in the plan but did not join as one");
    }
  }
  RoundStart round;
  for (size_t i = 0; i < plan.receivers.size(); ++i) {
    const PlanReceiver& r = plan.receivers[i];
    const std::string who = "receiver rank " + std::to_string(r.rank);
    if (r.rank >= world.size() || at(r.rank, kRole) != int64_t(Role::kReceiver)) {
      return failed_precondition("update: " + who + " is in the plan but did not join as one");
    }
    round.version = std::max(round.version, uint64_t(at(r.rank, kVersion)));
  }
  WL_RETURN_IF_ERROR(check_receiver_versions(
      plan, [&](int rank) { return uint64_t(at(rank, kVersion)); }, round.version));
  round.version += 1;
  round.slot = int(round.version % 2);
  if (receiver != nullptr && receiver->version() == 0) {
    round.fresh_write = receiver->begin_write(round.slot, deadline);
  }
  return round;
}

Status check_receiver_versions(const Plan& plan, const std::function<uint64_t(int)>& version_of,
                               uint64_t current) {
  for (const PlanReceiver& r : plan.receivers) {
    const uint64_t v = version_of(r.rank);
    if (v != current && v != 0) {
      return failed_precondition("update: receivers disagree on the current version (" +
                                 std::to_string(current) + " and " + std::to_string(v) +
                                 " at receiver rank " + std::to_string(r.rank) +
                                 "); nothing was written");
    }
  }
  return ok_status();
}

Status finish_round(comm::Group& world, Receiver* receiver, const RoundStart& round,
                    const Status& failed_here, std::chrono::milliseconds timeout) {
  const Status failed = failed_here.ok() ? round.fresh_write : failed_here;
  int64_t who = failed.ok() ? 0 : world.rank() + 1;
  WL_RETURN_IF_ERROR(comm::allreduce(world, {.send = &who,
                                             .recv = &who,
                                             .count = 1,
                                             .dtype = DType::kI64,
                                             .op = comm::ReduceOp::kMax,
                                             .timeout = timeout}));
  if (!failed.ok()) return failed;
  if (who != 0) {
    return aborted("update to version " + std::to_string(round.version) + ": world rank " +
                   std::to_string(who - 1) + " failed; every receiver stays on version " +
                   std::to_string(round.version - 1));
  }
  if (receiver != nullptr) receiver->publish(round.slot, round.version);
  return ok_status();
}

Result<UpdateReport> run_round(
    comm::Group& world, const Plan& plan, Receiver* receiver, const UpdateOptions& o,
    std::string_view mode, Status mine,
    const std::function<Status(const RoundStart&, UpdateReport&)>& body) {
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  const auto t_start = Clock::now();
  UpdateReport report;
  report.watermark_bytes = o.watermark_bytes;
  if (o.checksums || o.staging_hook) {
    mine =
        invalid_argument("world rank " + std::to_string(world.rank()) + ": " + std::string(mode) +
                         " mode has no per-task checksums or staging hook (p2p's)");
  }
  WL_ASSIGN_OR_RETURN(RoundStart round, start_round(world, plan, receiver, mine,
                                                    world.deadline(o.timeout), o.timeout));
  report.version = round.version;
  report.barrier_seconds += since(t_start);
  const Status failed = body(round, report);
  const auto t_barrier = Clock::now();
  WL_RETURN_IF_ERROR(finish_round(world, receiver, round, failed, o.timeout));
  report.barrier_seconds += since(t_barrier);
  report.total_seconds = since(t_start);
  return report;
}

}  // namespace wl::transfer
