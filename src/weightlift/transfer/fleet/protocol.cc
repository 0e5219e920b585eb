// Fleet records as JSON (fleet/protocol.h; docs/formats.md, "Fleet records").
#include "weightlift/transfer/fleet/protocol.h"

#include "weightlift/transfer/plan/metadata.h"
#include "weightlift/transfer/plan/plan_transfer.h"

namespace wl::transfer {
namespace {

constexpr RecordFormat kRoundFormat =
    fleet_record("weightlift-fleet-round", "fleet round record", /*version=*/3);
constexpr RecordFormat kJoinFormat = fleet_record("weightlift-fleet-join", "fleet join record");

}  // namespace

using json = nlohmann::json;

std::string round_to_json(const RoundRecord& r) {
  json j = new_record(kRoundFormat);
  j["kind"] = r.kind == RoundRecord::Kind::kForm     ? "form"
              : r.kind == RoundRecord::Kind::kRefuse ? "refuse"
                                                     : "update";
  j["round"] = r.round;
  j["generation"] = r.generation;
  j["servers"] = r.servers;
  json members = json::array();
  for (const FleetMember& m : r.members) members.push_back({{"id", m.id}, {"epoch", m.epoch}});
  j["members"] = members;
  j["lagging"] = r.lagging;
  j["dropped"] = r.dropped;
  j["checkpoint"] = r.checkpoint;
  j["mode"] = transfer_mode_name(r.mode);
  j["bucket_bytes"] = r.bucket_bytes;
  j["checksums"] = r.checksums;
  json refused = json::array();
  for (const Refusal& x : r.refused) {
    refused.push_back({{"id", x.receiver.id}, {"epoch", x.receiver.epoch}, {"reason", x.reason}});
  }
  j["refused"] = refused;
  j["replay"] = r.replay;
  return j.dump();
}

Result<RoundRecord> round_from_json(std::string_view text, std::string_view where) {
  return read_record<RoundRecord>(text, where, kRoundFormat, [](const json& j) {
    RoundRecord r;
    const std::string kind = j.at("kind").get<std::string>();
    if (kind != "form" && kind != "update" && kind != "refuse") {
      throw_field_error(j.at("kind"), "unknown kind " + kind);
    }
    r.kind = kind == "form"     ? RoundRecord::Kind::kForm
             : kind == "refuse" ? RoundRecord::Kind::kRefuse
                                : RoundRecord::Kind::kUpdate;
    r.round = uint_field(j.at("round"));
    r.generation = uint_field(j.at("generation"));
    r.servers = int32_field(j.at("servers"));
    for (const json& m : j.at("members")) {
      r.members.push_back({int32_field(m.at("id")), uint_field(m.at("epoch"))});
    }
    r.lagging = int32_array_field(j.at("lagging"));
    r.dropped = int32_array_field(j.at("dropped"));
    r.checkpoint = j.at("checkpoint").get<std::string>();
    const std::string mode = j.at("mode").get<std::string>();
    const std::optional<TransferMode> m = transfer_mode_from_name(mode);
    if (!m) throw_field_error(j.at("mode"), "unknown mode " + mode);
    r.mode = *m;
    r.bucket_bytes = int_field(j.at("bucket_bytes"));
    r.checksums = j.at("checksums").get<bool>();
    for (const json& x : j.value("refused", json::array())) {
      r.refused.push_back({{int32_field(x.at("id")), uint_field(x.at("epoch"))},
                           x.at("reason").get<std::string>()});
    }
    r.replay = uint_field(j.at("replay"));
    return r;
  });
}

std::string tensor_signature(const ReceiverTensorSpec& t) {
  std::string s = t.name + ":" + std::string(dtype_name(t.dtype)) + "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? "," : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string join_to_json(const JoinRecord& r) {
  json j = new_record(kJoinFormat);
  j["id"] = r.id;
  j["epoch"] = r.epoch;
  j["leave"] = r.leave;
  j["host"] = r.host;
  j["pid"] = r.pid;
  j["tp"] = r.tp;
  j["tp_rank"] = r.tp_rank;
  j["ep"] = r.ep;
  j["ep_rank"] = r.ep_rank;
  j["weight_format"] = r.format;
  j["tensors"] = r.tensors;
  return j.dump();
}

Result<JoinRecord> join_from_json(std::string_view text, std::string_view where) {
  return read_record<JoinRecord>(text, where, kJoinFormat, [](const json& j) {
    JoinRecord r{int32_field(j.at("id")), uint_field(j.at("epoch")), j.at("leave").get<bool>()};
    if (r.leave) return r;  // a leave names the receiver only
    r.host = uint_field(j.at("host"));
    r.pid = int_field(j.at("pid"));
    r.tp = int32_field(j.at("tp"));
    r.tp_rank = int32_field(j.at("tp_rank"));
    if (j.contains("ep")) r.ep = int32_field(j.at("ep"));  // absent: written before EP engines
    if (j.contains("ep_rank")) r.ep_rank = int32_field(j.at("ep_rank"));
    r.format = j.at("weight_format").get<std::string>();
    r.tensors = j.at("tensors").get<std::vector<std::string>>();
    return r;
  });
}

Result<std::unique_ptr<UpdateExecutor>> make_generation_executor(
    const GenerationExecutorOptions& o) {
  const int rank = o.world->rank();
  const RankMeta mine = o.weights != nullptr ? describe_trainer(rank, *o.weights)
                                             : describe_receiver(rank, *o.receiver);
  WL_ASSIGN_OR_RETURN(Plan plan, plan_transfer(*o.world, mine, {.timeout = o.timeout}));
  return make_update_executor({.world = o.world,
                               .plan = std::move(plan),
                               .weights = o.weights,
                               .receiver = o.receiver,
                               .mode = o.mode,
                               .bucket_bytes = size_t(o.bucket_bytes)});
}

Result<std::optional<JoinRecord>> read_join(comm::Store& store, const FleetKeys& keys, int64_t k,
                                            std::chrono::milliseconds wait) {
  Result<comm::Bytes> b = store.get(keys.join(k), wait);
  if (!b.ok() && b.status().code() == StatusCode::kDeadlineExceeded) {
    return std::optional<JoinRecord>();
  }
  if (!b.ok()) return b.status().with_context("reading " + keys.join(k));
  WL_ASSIGN_OR_RETURN(JoinRecord j, join_from_json(comm::to_string(*b), keys.join(k)));
  return std::optional(std::move(j));
}

Result<uint64_t> last_round_posted(comm::Store& store, const FleetKeys& keys) {
  WL_ASSIGN_OR_RETURN(const int64_t counted, store.add(keys.rounds(), 0));
  uint64_t last = uint64_t(counted);
  for (;;) {
    Result<comm::Bytes> next = store.get(keys.round(last + 1), std::chrono::milliseconds(0));
    if (next.ok()) {
      ++last;
      continue;
    }
    if (next.status().code() == StatusCode::kDeadlineExceeded) return last;
    return next.status().with_context("reading " + keys.round(last + 1));
  }
}

comm::ConnectOptions fleet_connect_options(const FleetKeys& keys, std::string group_prefix,
                                           std::shared_ptr<comm::Store> store,
                                           std::shared_ptr<comm::Transport> worker, int rank,
                                           int size, std::chrono::milliseconds timeout) {
  return {.store = std::move(store),
          .rank = rank,
          .size = size,
          .timeout = timeout,
          .prefix = std::move(group_prefix),
          .transport = std::move(worker),
          .ids_key = keys.group_ids()};
}

}  // namespace wl::transfer
