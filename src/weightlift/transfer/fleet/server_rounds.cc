// The parameter server's side of the fleet protocol (fleet/protocol.h): who has joined, the
// round each update is (a new generation, a replay, a refusal) and how the server ranks agree
// on it. ParameterServer::update (parameter_server.cc) runs them.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/transfer/fleet/parameter_server_impl.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/layout_spec.h"

namespace wl::transfer {

Status ParameterServer::Impl::read_joins() {
  WL_ASSIGN_OR_RETURN(int64_t total, options.store->add(keys.joins(), 0));
  // Slots passed over before (kJoinGrace), looked at again without waiting (a record only slow to
  // come is taken then, late: in the worst case it names a receiver that has left since, which the
  // next form round leaves out as silent).
  for (auto k = missing_joins.begin(); k != missing_joins.end();) {
    WL_ASSIGN_OR_RETURN(std::optional<JoinRecord> j,
                        read_join(*options.store, keys, *k, std::chrono::milliseconds(0)));
    if (!j) {
      ++k;
      continue;
    }
    take_join(*std::move(j));
    k = missing_joins.erase(k);
  }
  for (int64_t k = joins_seen + 1; k <= total; ++k) {
    WL_ASSIGN_OR_RETURN(std::optional<JoinRecord> j,
                        read_join(*options.store, keys, k, std::min(options.timeout, kJoinGrace)));
    joins_seen = k;
    if (j) {
      take_join(*std::move(j));
    } else {
      missing_joins.insert(k);
    }
  }
  return ok_status();
}

void ParameterServer::Impl::take_join(JoinRecord j) {
  if (j.leave) {
    processes.erase({j.id, j.epoch});
    if (joined.count(j.id) && joined[j.id] == j.epoch) {
      joined.erase(j.id);
      holders.erase(j.id);
      auto c = contenders.find(j.id);  // the id is free: its contender takes it
      if (c != contenders.end()) {
        joined[j.id] = c->second.epoch;
        holders[j.id] = std::move(c->second);
        contenders.erase(c);
      }
    }
    if (contenders.count(j.id) && contenders[j.id].epoch == j.epoch) contenders.erase(j.id);
    return;
  }
  processes[{j.id, j.epoch}] = {j.host, j.pid};
  auto held = holders.find(j.id);
  if (held == holders.end() || held->second.epoch == j.epoch) {
    joined[j.id] = j.epoch;
    holders[j.id] = std::move(j);
    return;
  }
  auto c = contenders.find(j.id);
  if (c != contenders.end() && c->second.epoch != j.epoch && options.rank == 0) {
    refusals.push_back({{j.id, c->second.epoch},
                        "a newer receiver with id " + std::to_string(j.id) +
                            " joined before this one was let in"});
  }
  contenders[j.id] = std::move(j);
}

Result<RoundRecord> ParameterServer::Impl::post(RoundRecord r) {
  r.round = round + 1;
  r.servers = options.size;
  const std::string json = round_to_json(r);
  // The number is taken once the round is there: a gap would stop last_round_posted() short.
  WL_RETURN_IF_ERROR(options.store->set(keys.round(r.round), comm::to_bytes(json)));
  round = r.round;
  if (r.kind == RoundRecord::Kind::kUpdate) replays = 0;
  WL_RETURN_IF_ERROR(options.store->add(keys.rounds(), int64_t(r.round - counted)).status());
  counted = r.round;
  return r;
}

RoundRecord ParameterServer::Impl::replay(RoundRecord r) {
  r.round = round;
  r.replay = ++replays;
  r.servers = options.size;
  return r;
}

// Every member at once. A member needs no member list (it is one), so the record stays a few
// hundred bytes whatever the fleet's size: eager sends, complete here.
Status ParameterServer::Impl::send_replay(const RoundRecord& r) {
  RoundRecord sent_record = r;
  sent_record.members.clear();
  const std::string body = round_to_json(sent_record);
  const uint64_t length = body.size();
  std::vector<comm::Request> sent;
  for (int i = 0; i < int(r.members.size()); ++i) {
    for (auto [data, bytes, tag] :
         {std::tuple<const void*, size_t, uint32_t>{&length, sizeof length, kReplayLengthTag},
          {body.data(), body.size(), kReplayTag}}) {
      Result<comm::Request> s =
          group->start_send({.data = data, .bytes = bytes, .peer = r.servers + i, .tag = tag});
      WL_CHECK(s.ok()) << s.status().to_string();  // only a bad tag or peer fails here
      sent.push_back(*std::move(s));
    }
  }
  return group->wait_all(sent, group->deadline(options.timeout))
      .with_context("sending generation " + std::to_string(r.generation) + "'s replay " +
                    std::to_string(r.replay) + " to its members");
}

bool ParameterServer::Impl::members_leaving() {
  if (group == nullptr) return false;
  bool leaving = false;
  for (int i = 0; i < int(members.size()); ++i) {
    const int peer = options.size + i;
    if (!group->probe(peer, kLeaveTag)) continue;
    leaving = true;
    uint64_t epoch = 0;  // taken so that it does not wait in UCX for the group's whole life
    (void)group->recv({.data = &epoch,
                       .bytes = sizeof epoch,
                       .peer = peer,
                       .tag = kLeaveTag,
                       .timeout = options.timeout});
  }
  return leaving;
}

bool ParameterServer::Impl::names_the_members(const std::string& name,
                                              std::span<const int> receivers) {
  if (receivers.empty() || receivers.size() != members.size() || !contenders.empty() ||
      !refusals.empty()) {
    return false;
  }
  for (size_t i = 0; i < members.size(); ++i) {
    const FleetMember& m = members[i];
    // Still joined as far as we know (an update may have read its leave since), and known to
    // fit the checkpoint.
    auto j = joined.find(m.id);
    if (receivers[i] != m.id || j == joined.end() || j->second != m.epoch ||
        !fits.count({m.id, m.epoch, name})) {
      return false;
    }
  }
  return true;
}

std::string ParameterServer::Impl::layout_mismatch(const std::string& name, const JoinRecord& j) {
  if (fits.count({j.id, j.epoch, name})) return "";
  const TrainerWeights& w = *checkpoints.at(name).weights;
  const std::optional<WeightFormat> format = weight_format_from_name(j.format);
  if (!format) return "it holds format '" + j.format + "'";
  if (!w.config() && j.ep > 1) return "a layout spec's model has no expert-parallel layout";
  auto expected = w.config()
                      ? inference_layout(*w.config(), {.tp = j.tp,
                                                       .tp_rank = j.tp_rank,
                                                       .ep = j.ep,
                                                       .ep_rank = j.ep_rank,
                                                       .format = *format})
                      : spec_layout(spec_in_format(*w.layout_spec(), *format), j.tp, j.tp_rank);
  if (!expected.ok()) return expected.status().message();
  const std::vector<ReceiverTensorSpec> specs = tensor_specs(*expected);
  std::set<std::string> want, have(j.tensors.begin(), j.tensors.end());
  for (const ReceiverTensorSpec& s : specs) want.insert(tensor_signature(s));
  for (const std::string& t : j.tensors) {
    if (!want.count(t)) return "it holds " + t + ", which the layout has not";
  }
  for (const ReceiverTensorSpec& s : specs) {
    if (!have.count(tensor_signature(s))) {
      return "it lacks " + tensor_signature(s) + ", which the layout has";
    }
  }
  fits.insert({j.id, j.epoch, name});
  return "";
}

// Rank 0: the members an update of `name` asks for: everyone who joined, or the ones named.
// One whose layout is no held checkpoint's is turned away; one whose layout is another
// checkpoint's sits this update out.
Result<std::vector<FleetMember>> ParameterServer::Impl::wanted(const std::string& name,
                                                               std::span<const int> receivers) {
  WL_RETURN_IF_ERROR(read_joins());
  std::vector<int> ids(receivers.begin(), receivers.end());
  if (ids.empty()) {
    for (const auto& [id, epoch] : joined) ids.push_back(id);
  }
  std::vector<FleetMember> out;
  for (int id : ids) {
    auto it = joined.find(id);
    if (it == joined.end()) {
      return not_found("update '" + name + "': receiver " + std::to_string(id) +
                       " has not joined the fleet (or has left it)");
    }
    const std::string why = layout_mismatch(name, holders.at(id));
    if (why.empty()) {
      out.push_back({id, it->second});
      continue;
    }
    const bool fits_another =
        receivers.empty() &&
        std::any_of(checkpoints.begin(), checkpoints.end(), [&](const auto& held) {
          return held.first != name && layout_mismatch(held.first, holders.at(id)).empty();
        });
    if (fits_another) continue;
    refusals.push_back({{id, it->second},
                        "its layout is not checkpoint '" + name + "''s inference layout of " +
                            describe_rank({.tp = holders.at(id).tp,
                                           .tp_rank = holders.at(id).tp_rank,
                                           .ep = holders.at(id).ep,
                                           .ep_rank = holders.at(id).ep_rank}) +
                            " (" + holders.at(id).format + "): " + why});
    joined.erase(id);
    holders.erase(id);
  }
  return out;
}

Status ParameterServer::Impl::post_refusals() {
  if (refusals.empty()) return ok_status();
  RoundRecord r{.kind = RoundRecord::Kind::kRefuse, .generation = generation};
  r.refused = std::move(refusals);
  refusals.clear();
  return post(std::move(r)).status();
}

// Rank 0: whether the current generation can no longer carry an update. A member whose
// connection has failed since the last update (UCX noticed it die) makes it unusable; nothing
// progressed the worker since the last update, so it first takes in what happened meanwhile.
// UCX notices a dead peer only when something moves to it or its keepalive fires, which can
// be after this update has failed on it; a member on this host whose process is gone (its
// join record named the process) is known dead now. Nothing here waits on the store: this runs
// before every update.
bool ParameterServer::Impl::generation_broken() {
  if (broken) return true;
  for (int i = 0; i < 100 && worker->progress(); ++i) {
  }
  for (int rank = 0; group != nullptr && rank < group->size(); ++rank) {
    if (rank != group->rank() && !group->worker().peer_status(group->worker_peer(rank)).ok()) {
      return true;
    }
  }
  for (const FleetMember& m : members) {
    auto p = processes.find({m.id, m.epoch});
    if (p != processes.end() && !comm::process_may_be_alive(p->second)) return true;
  }
  return false;
}

// Rank 0: the version receiver `j` answered form round `round_number` with, by `deadline`;
// NotFound if it exited or stayed silent.
Result<uint64_t> ParameterServer::Impl::ack_of(uint64_t round_number, const JoinRecord& j,
                                               comm::Deadline deadline) {
  // One known to have exited (on this host) is not waited for.
  if (!comm::process_may_be_alive({j.host, j.pid})) return not_found("exited");
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - comm::Clock::now());
  auto ack = options.store->get(keys.ack(round_number, j.id, j.epoch),
                                std::max(left, std::chrono::milliseconds(1)));
  unsigned long long epoch = 0, version = 0;
  if (!ack.ok() || std::sscanf(comm::to_string(*ack).c_str(), "%llu %llu", &epoch, &version) != 2 ||
      epoch != j.epoch) {
    return not_found("silent");
  }
  return uint64_t(version);
}

// Rank 0: who answers a form round of `wanted` and the contenders for their ids: the
// candidates that answered, with the version each holds; the others dropped. A contender whose
// holder answered is turned away; one whose holder is silent takes the id.
Result<std::vector<std::pair<FleetMember, uint64_t>>> ParameterServer::Impl::answers(
    const std::string& name, const std::vector<FleetMember>& wanted, RoundRecord& update) {
  std::vector<FleetMember> candidates = wanted;
  for (const FleetMember& m : wanted) {
    auto c = contenders.find(m.id);
    if (c == contenders.end()) continue;
    const std::string why = layout_mismatch(name, c->second);
    if (!why.empty()) {
      refusals.push_back(
          {{m.id, c->second.epoch},
           "its layout is not checkpoint '" + name + "''s inference layout: " + why});
      contenders.erase(c);
      continue;
    }
    candidates.push_back({m.id, c->second.epoch});
  }
  WL_ASSIGN_OR_RETURN(RoundRecord form, post({.kind = RoundRecord::Kind::kForm,
                                              .generation = generation + 1,
                                              .members = candidates}));
  const comm::Deadline deadline = comm::deadline_after(options.join_timeout);
  std::vector<std::pair<FleetMember, uint64_t>> answered;
  for (const FleetMember& m : wanted) {
    Result<uint64_t> held = ack_of(form.round, holders.at(m.id), deadline);
    auto c = contenders.find(m.id);
    if (c != contenders.end()) {
      JoinRecord contender = std::move(c->second);
      contenders.erase(c);
      if (held.ok()) {
        refusals.push_back({{m.id, contender.epoch},
                            "receiver id " + std::to_string(m.id) +
                                " is held by another receiver, which answered round " +
                                std::to_string(form.round) +
                                "; start this one with another id, or stop that one first"});
      } else {
        holders[m.id] = std::move(contender);
        joined[m.id] = holders[m.id].epoch;
        held = ack_of(form.round, holders[m.id], deadline);
      }
    }
    if (held.ok()) {
      answered.emplace_back(FleetMember{m.id, holders[m.id].epoch}, *held);
      continue;
    }
    update.dropped.push_back(m.id);
    joined.erase(m.id);  // it announces itself again when it is back (fleet_receiver.h)
    holders.erase(m.id);
  }
  return answered;
}

// Rank 0: posts a form round for `wanted` and fills `update` with those that answer within the
// join timeout holding a version the next update can bring them to (can_take_next_version:
// the newest among the answers, none, or one an even number behind it); the others are
// dropped, the ones behind by an odd number as lagging (they announce themselves again, and
// the generation formed after the next update takes them).
Status ParameterServer::Impl::form(const std::string& name, const std::vector<FleetMember>& wanted,
                                   RoundRecord& update) {
  WL_ASSIGN_OR_RETURN(auto answered, answers(name, wanted, update));
  uint64_t newest = 0;
  for (const auto& [m, version] : answered) newest = std::max(newest, version);
  update.members.clear();
  for (const auto& [m, version] : answered) {
    if (can_take_next_version(version, newest)) {
      update.members.push_back(m);
    } else {
      update.dropped.push_back(m.id);
      update.lagging.push_back(m.id);
      joined.erase(m.id);
      holders.erase(m.id);
    }
  }
  update.generation = generation + 1;
  return ok_status();
}

// Rank 0: which receivers this update goes to, forming a generation first when needed (the
// set changed, or the current one broke).
Result<RoundRecord> ParameterServer::Impl::decide(const std::string& name,
                                                  std::span<const int> receivers, bool checksums) {
  RoundRecord update = generation_update(name, checksums);
  broken = generation_broken();
  WL_ASSIGN_OR_RETURN(std::vector<FleetMember> want, wanted(name, receivers));
  auto same = [](const std::vector<FleetMember>& a, const std::vector<FleetMember>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](auto& x, auto& y) {
             return x.id == y.id && x.epoch == y.epoch;
           });
  };
  const bool contested = std::any_of(want.begin(), want.end(),
                                     [&](const FleetMember& m) { return contenders.count(m.id); });
  if (broken || !same(want, members) || contested) WL_RETURN_IF_ERROR(form(name, want, update));
  // Turned away before the round that leaves them out: they stop, not announce again.
  WL_RETURN_IF_ERROR(post_refusals());
  // The same generation, nothing failed: its group carries the update (protocol.h).
  if (update.generation == generation) return replay(std::move(update));
  return post(update);
}

// Rank 0's decision (or its refusal) to every server rank.
Result<RoundRecord> ParameterServer::Impl::share(Result<RoundRecord> decided) {
  if (options.size == 1) return decided;  // rank 0 alone: nothing to tell
  std::string body;
  int64_t header[2] = {0, 0};  // status code, body length
  if (options.rank == 0) {
    body = decided.ok() ? round_to_json(*decided) : decided.status().message();
    header[0] = decided.ok() ? 0 : int64_t(decided.status().code());
    header[1] = int64_t(body.size());
  }
  Status sent = comm::broadcast(*servers, {.buffer = header, .count = 2, .dtype = DType::kI64});
  if (sent.ok()) {
    body.resize(size_t(header[1]));
    sent = comm::broadcast(*servers,
                           {.buffer = body.data(), .count = body.size(), .dtype = DType::kU8});
  }
  if (!sent.ok()) {
    broken = rebuild = true;  // the servers' own group failed: every rank finds that out
    return sent.with_context("sharing server rank 0's round");
  }
  if (header[0] != 0) return Status(StatusCode(header[0]), body);
  return round_from_json(body, "round record from server rank 0");
}

RoundRecord ParameterServer::Impl::generation_update(const std::string& name,
                                                     bool checksums) const {
  return {.kind = RoundRecord::Kind::kUpdate,
          .generation = generation,
          .servers = options.size,
          .members = members,
          .checkpoint = name,
          .mode = options.mode,
          .bucket_bytes = options.bucket_bytes,
          .checksums = checksums};
}

bool ParameterServer::Impl::can_replay(const std::string& name, std::span<const int> receivers) {
  broken = generation_broken();
  return !broken && !members_leaving() && names_the_members(name, receivers);
}

Result<RoundRecord> ParameterServer::Impl::open_update(const std::string& name, bool holds,
                                                       std::span<const int> receivers,
                                                       bool checksums) {
  const std::string what = "update '" + name + "': holding the checkpoint";
  // A rank whose register_checkpoint failed (a corrupt file on its disk) holds nothing to send.
  const Status mine = holds ? ok_status()
                            : not_found("update: server rank " + std::to_string(options.rank) +
                                        " holds no checkpoint '" + name + "'");
  const bool quick = options.rank == 0 && holds && can_replay(name, receivers);
  // Who does not hold it (rank + 1, the highest), and rank 0's replay: 1, its round, its number.
  int64_t words[4] = {holds ? 0 : int64_t(options.rank) + 1, quick ? 1 : 0,
                      quick ? int64_t(round) : 0, quick ? int64_t(replays + 1) : 0};
  if (options.size > 1) {
    Status agreed = comm::allreduce(
        *servers, {.recv = words, .count = 4, .dtype = DType::kI64, .op = comm::ReduceOp::kMax});
    if (!agreed.ok()) {
      broken = rebuild = true;  // as in agree()
      return mine.ok() ? agreed.with_context("agreeing on " + what) : mine;
    }
  }
  if (!mine.ok()) return mine;
  if (words[0] != 0) {
    return aborted(what + " failed on server rank " + std::to_string(words[0] - 1) +
                   " (its error says why)");
  }
  if (words[1] == 0) {
    Result<RoundRecord> decided = RoundRecord{};  // rank 0's is shared
    if (options.rank == 0) decided = decide(name, receivers, checksums);
    return share(std::move(decided));
  }
  // Every rank's call asks for the same update, and every rank holds the generation.
  RoundRecord r = generation_update(name, checksums);
  r.round = uint64_t(words[2]);
  r.replay = uint64_t(words[3]);
  if (options.rank == 0) replays = r.replay;
  return r;
}

Status ParameterServer::Impl::enter_generation(const RoundRecord& r) {
  if (r.generation == generation && group != nullptr && !broken) return ok_status();
  executors.clear();
  group.reset();
  generation = r.generation;
  members = r.members;
  broken = true;
  WL_ASSIGN_OR_RETURN(group,
                      comm::Group::connect(fleet_connect_options(
                          keys, keys.generation(r.generation), options.store, worker, options.rank,
                          r.servers + int(r.members.size()), options.timeout)));
  broken = false;
  return ok_status();
}

Status ParameterServer::Impl::agree(Status mine, const std::string& what) {
  int64_t failed = mine.ok() ? 0 : int64_t(options.rank) + 1;
  Status agreed = comm::allreduce(
      *servers, {.recv = &failed, .count = 1, .dtype = DType::kI64, .op = comm::ReduceOp::kMax});
  if (!agreed.ok()) {
    // The servers' own group failed (a server rank died, or its worker did): some ranks may
    // have the answer and others not, so every rank that sees the failure reconnects, and
    // the ranks that did not see it fail on their next collective over the old group.
    broken = rebuild = true;
    return mine.ok() ? agreed.with_context("agreeing on " + what) : mine;
  }
  if (!mine.ok()) return mine;
  if (failed == 0) return ok_status();
  return aborted(what + " failed on server rank " + std::to_string(failed - 1) +
                 " (its error says why)");
}

Status ParameterServer::Impl::prepare(const std::string& name, TrainerWeights* weights,
                                      const RoundRecord& r) {
  WL_RETURN_IF_ERROR(
      enter_generation(r).with_context("connecting generation " + std::to_string(r.generation)));
  if (executors.count(name)) return ok_status();
  Result<std::unique_ptr<UpdateExecutor>> made =
      make_generation_executor({.world = group,
                                .weights = weights,
                                .mode = r.mode,
                                .bucket_bytes = r.bucket_bytes,
                                .timeout = options.timeout});
  if (!made.ok()) return made.status().with_context("planning");
  executors.emplace(name, *std::move(made));
  return ok_status();
}

}  // namespace wl::transfer
