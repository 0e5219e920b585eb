// make_update_executor (update_executor.h): the checks every mode shares, then the mode.
#include "weightlift/transfer/modes/update_executor.h"

#include <string>
#include <vector>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/transfer/modes/broadcast.h"
#include "weightlift/transfer/modes/detail/update_round.h"
#include "weightlift/transfer/modes/naive.h"
#include "weightlift/transfer/modes/p2p.h"

namespace wl::transfer {
namespace {

// Per rank: its refusal, the mode, the bucket size and (trainers) its shard dtype + 1.
enum AgreementField {
  kAgreedRefusal,
  kAgreedMode,
  kAgreedBucketBytes,
  kAgreedShardDtype,
  kAgreedFields
};

// This rank's objection to the options, before anything collective.
Status check_locally(const ExecutorOptions& o) {
  const int me = o.world->rank();
  if ((o.weights == nullptr) == (o.receiver == nullptr)) {
    return invalid_argument("world rank " + std::to_string(me) +
                            ": an executor needs exactly one of weights (a trainer) and a "
                            "receiver");
  }
  if (o.mode != TransferMode::kP2P && o.plan.config_json.empty()) {
    return invalid_argument("world rank " + std::to_string(me) + ": the " +
                            std::string(transfer_mode_name(o.mode)) +
                            " mode moves weightlift's own model only; this plan's trainers hold "
                            "another model's weights (a layout spec): use p2p");
  }
  if (o.weights != nullptr) return place_trainer(o.plan, me, *o.weights).status();
  return place_receiver(o.plan, me).status();
}

// Collective: every rank learns every other's refusal, and the trainers' shard dtype; the
// ranks must agree on the mode and its settings.
Result<DType> agree(const ExecutorOptions& o, const Status& mine) {
  comm::Group& world = *o.world;
  int64_t word[kAgreedFields] = {
      int64_t(mine.code()), int64_t(o.mode), int64_t(o.bucket_bytes),
      o.weights && mine.ok() ? int64_t(o.weights->options().dtype) + 1 : 0};
  std::vector<int64_t> words(size_t(world.size()) * kAgreedFields);
  WL_RETURN_IF_ERROR(comm::allgather(
      world, {.send = word, .recv = words.data(), .count = kAgreedFields, .dtype = DType::kI64}));
  auto at = [&](int r, AgreementField f) { return words[size_t(r) * kAgreedFields + f]; };
  if (!mine.ok()) return mine;  // a rank that refused says its own reason
  int64_t dtype = 0;
  for (int r = 0; r < world.size(); ++r) {
    const std::string who = "world rank " + std::to_string(r);
    if (at(r, kAgreedRefusal) != 0) {
      return Status(StatusCode(at(r, kAgreedRefusal)),
                    "transfer executor refused by " + who + " (its own error says why)");
    }
    if (at(r, kAgreedMode) != at(0, kAgreedMode) ||
        at(r, kAgreedBucketBytes) != at(0, kAgreedBucketBytes)) {
      return failed_precondition(
          "world ranks 0 and " + std::to_string(r) + " disagree on the transfer mode (" +
          std::string(transfer_mode_name(TransferMode(at(0, kAgreedMode)))) + " and " +
          std::string(transfer_mode_name(TransferMode(at(r, kAgreedMode)))) +
          ") or its bucket bytes (" + std::to_string(at(0, kAgreedBucketBytes)) + " and " +
          std::to_string(at(r, kAgreedBucketBytes)) + ")");
    }
    const int64_t d = at(r, kAgreedShardDtype);
    if (d == 0) continue;
    if (dtype != 0 && d != dtype) {
      return failed_precondition("trainers hold shards of different dtypes (" +
                                 std::string(dtype_name(DType(dtype - 1))) + " and " +
                                 std::string(dtype_name(DType(d - 1))) + " at " + who + ")");
    }
    dtype = d;
  }
  if (dtype == 0) return failed_precondition("no trainer joined the transfer");
  return DType(dtype - 1);
}

}  // namespace

std::string_view transfer_mode_name(TransferMode mode) {
  switch (mode) {
    case TransferMode::kP2P:
      return "p2p";
    case TransferMode::kBroadcast:
      return "broadcast";
    case TransferMode::kNaive:
      return "naive";
  }
  return "unknown";
}

std::optional<TransferMode> transfer_mode_from_name(std::string_view name) {
  for (TransferMode m : {TransferMode::kP2P, TransferMode::kBroadcast, TransferMode::kNaive}) {
    if (transfer_mode_name(m) == name) return m;
  }
  return std::nullopt;
}

Result<std::unique_ptr<UpdateExecutor>> make_update_executor(ExecutorOptions options) {
  if (options.world == nullptr) return invalid_argument("transfer executor: no world group");
  WL_ASSIGN_OR_RETURN(const DType shard_dtype, agree(options, check_locally(options)));
  switch (options.mode) {
    case TransferMode::kP2P:
      return make_p2p_executor(std::move(options));
    case TransferMode::kBroadcast:
      return make_broadcast_executor(std::move(options), shard_dtype);
    case TransferMode::kNaive:
      return make_naive_executor(std::move(options), shard_dtype);
  }
  return invalid_argument("transfer executor: unknown mode " + std::to_string(int(options.mode)));
}

}  // namespace wl::transfer
