// FleetReceiver: the receiver side of the fleet protocol (fleet/protocol.h).
#include "weightlift/transfer/fleet/fleet_receiver.h"

#include <algorithm>
#include <map>

#include "weightlift/transfer/fleet/heal_from_servers.h"

namespace wl::transfer {
namespace {
constexpr std::chrono::milliseconds kPoll{10};  // store polls between worker progress
}  // namespace

struct FleetReceiver::Impl {
  FleetReceiverOptions options;
  FleetKeys keys;
  // Declared before the worker so that it goes after it (layout/receiver.h: a put abandoned
  // by its sender may still reach the slots while the worker closes).
  std::unique_ptr<Receiver> receiver;
  std::shared_ptr<comm::Worker> worker;
  uint64_t healed = 0;
  std::string heal_log;

  uint64_t next_round = 1;
  uint64_t generation = 0;  // the one this receiver is connected to (0: none)
  std::shared_ptr<comm::Group> group;
  std::map<std::string, std::unique_ptr<UpdateExecutor>> executors;  // by checkpoint
  bool member = false;                                               // joined and not left

  Status announce(bool leave);
  Status publish_peer_record();
  // After a failed round: drops the generation and, if the worker became unusable
  // (transport.h), moves the receiver's memory to a new one.
  Status recover();
  void heal();
  // With no peer of our shard: from the servers' copy of the last checkpoint sent.
  void heal_from_server_copy();
  Result<comm::Bytes> wait_for(const std::string& key, comm::Deadline deadline);
};

FleetReceiver::FleetReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FleetReceiver::~FleetReceiver() = default;

Receiver& FleetReceiver::receiver() { return *impl_->receiver; }
uint64_t FleetReceiver::healed_version() const { return impl_->healed; }
std::string FleetReceiver::heal_log() const { return impl_->heal_log; }

Status FleetReceiver::Impl::announce(bool leave) {
  WL_ASSIGN_OR_RETURN(int64_t k, options.store->add(keys.joins(), 1));
  const JoinRecord j{options.id, receiver->epoch(), leave};
  WL_RETURN_IF_ERROR(options.store->set(keys.join(k), comm::to_bytes(join_to_json(j))));
  member = !leave;
  return ok_status();
}

void FleetReceiver::Impl::heal() {
  // Every receiver that ever joined may have left a peer record; try those with our layout.
  auto total = options.store->add(keys.joins(), 0);
  if (!total.ok()) return;
  std::map<int, bool> left;  // id -> whether its latest record says it left
  for (int64_t k = 1; k <= *total; ++k) {
    auto b = options.store->get(keys.join(k), options.timeout);
    if (!b.ok()) continue;
    auto j = join_from_json(comm::to_string(*b), keys.join(k));
    if (j.ok() && j->id != options.id) left[j->id] = j->leave;
  }
  std::vector<int> ids;
  for (const auto& [id, gone] : left) {
    if (!gone) ids.push_back(id);
  }
  const std::string mine = layout_fingerprint(*receiver);
  for (int id : ids) {
    auto b = options.store->get(keys.peer(id), std::chrono::milliseconds(1));
    if (!b.ok()) continue;
    auto peer = peer_record_from_json(comm::to_string(*b), keys.peer(id));
    if (!peer.ok()) {
      heal_log += peer.status().to_string() + "\n";
      continue;
    }
    if (peer->fingerprint != mine) continue;  // another shard: nothing to copy from it
    auto v = heal_from_peer(*worker, *receiver, *peer, options.heal_options);
    if (v.ok()) {
      healed = *v;
      heal_log += "healed version " + std::to_string(*v) + " from " + peer->name + "\n";
      return;
    }
    heal_log += v.status().to_string() + "\n";
  }
  heal_from_server_copy();
}

void FleetReceiver::Impl::heal_from_server_copy() {
  Result<std::vector<ServerCopyRecord>> records = read_server_copies(*options.store, keys);
  if (!records.ok()) {
    heal_log += records.status().to_string() + "\n";
    return;
  }
  auto v = heal_from_servers(*worker, *receiver, *records, options.heal_options);
  if (!v.ok()) {
    heal_log += v.status().to_string() + "\n";
    return;
  }
  healed = *v;
  heal_log += "healed version " + std::to_string(*v) + " from the servers' copy of '" +
              records->front().checkpoint + "'\n";
}

Result<std::unique_ptr<FleetReceiver>> FleetReceiver::create(const FleetReceiverOptions& o) {
  if (o.store == nullptr) return invalid_argument("fleet receiver: no store");
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  impl->keys = {o.prefix};
  const std::string name = "receiver " + std::to_string(o.id);
  WL_ASSIGN_OR_RETURN(std::unique_ptr<comm::Worker> worker, comm::Worker::create({.name = name}));
  impl->worker = std::move(worker);
  WL_ASSIGN_OR_RETURN(impl->receiver, Receiver::create(*impl->worker, o.receiver));
  // Rounds posted before we announce cannot name us: start after the last one.
  WL_ASSIGN_OR_RETURN(int64_t posted, o.store->add(impl->keys.rounds(), 0));
  impl->next_round = uint64_t(posted) + 1;
  if (o.heal) impl->heal();
  WL_RETURN_IF_ERROR(impl->publish_peer_record());
  WL_RETURN_IF_ERROR(impl->announce(false));
  return std::unique_ptr<FleetReceiver>(new FleetReceiver(std::move(impl)));
}

Status FleetReceiver::Impl::publish_peer_record() {
  const std::string name = "receiver " + std::to_string(options.id);
  return options.store->set(keys.peer(options.id),
                            comm::to_bytes(peer_record_to_json(peer_record(*receiver, name))));
}

Status FleetReceiver::Impl::recover() {
  executors.clear();
  group.reset();
  generation = 0;
  if (worker->status().ok()) return ok_status();
  WL_ASSIGN_OR_RETURN(std::unique_ptr<comm::Worker> fresh,
                      comm::Worker::create({.name = "receiver " + std::to_string(options.id)}));
  WL_RETURN_IF_ERROR(receiver->attach(*fresh));
  worker = std::move(fresh);
  return publish_peer_record();
}

Result<comm::Bytes> FleetReceiver::Impl::wait_for(const std::string& key, comm::Deadline deadline) {
  for (;;) {
    auto b = options.store->get(key, kPoll);
    if (b.ok() || b.status().code() != StatusCode::kDeadlineExceeded) return b;
    while (worker->progress()) {
    }
    if (comm::Clock::now() >= deadline) {
      return deadline_exceeded("receiver " + std::to_string(options.id) +
                               ": no round posted "
                               "under '" +
                               key + "' yet");
    }
  }
}

Result<RoundOutcome> FleetReceiver::serve_one(std::chrono::milliseconds wait) {
  Impl& m = *impl_;
  const std::string key = m.keys.round(m.next_round);
  WL_ASSIGN_OR_RETURN(comm::Bytes b, m.wait_for(key, comm::deadline_after(wait)));
  WL_ASSIGN_OR_RETURN(RoundRecord r, round_from_json(comm::to_string(b), key));
  ++m.next_round;
  RoundOutcome out{.round = r.round, .kind = r.kind, .version = m.receiver->version()};
  const uint64_t epoch = m.receiver->epoch();
  auto me = std::find_if(r.members.begin(), r.members.end(), [&](const FleetMember& f) {
    return f.id == m.options.id && f.epoch == epoch;
  });
  const bool named = me != r.members.end();

  if (r.kind == RoundRecord::Kind::kForm) {
    if (named && m.member) {
      const std::string ack = std::to_string(epoch) + " " + std::to_string(m.receiver->version());
      WL_RETURN_IF_ERROR(
          m.options.store->set(m.keys.ack(r.round, m.options.id), comm::to_bytes(ack)));
      out.took_part = true;
    }
    return out;
  }

  if (r.generation != m.generation) {
    m.executors.clear();
    m.group.reset();
    m.generation = 0;
    if (std::find(r.lagging.begin(), r.lagging.end(), m.options.id) != r.lagging.end()) {
      m.member = false;
      return failed_precondition("receiver " + std::to_string(m.options.id) + " holds version " +
                                 std::to_string(m.receiver->version()) +
                                 ", older than the rest of the fleet (it " +
                                 "missed updates), so generation " + std::to_string(r.generation) +
                                 " left it out; restart it to heal from a peer");
    }
    if (!named) {
      // Left out of a new generation while we think we belong: the servers dropped us (we
      // answered too late, or they thought us dead). Announce again for the next one.
      if (m.member) WL_RETURN_IF_ERROR(m.announce(false));
      return out;
    }
    const int rank = r.servers + int(me - r.members.begin());
    auto group = comm::Group::connect(
        fleet_connect_options(m.keys, m.keys.generation(r.generation), m.options.store, m.worker,
                              rank, r.servers + int(r.members.size()), m.options.timeout));
    if (!group.ok()) {
      WL_RETURN_IF_ERROR(m.recover());
      return group.status().with_context("receiver " + std::to_string(m.options.id) +
                                         ": joining generation " + std::to_string(r.generation));
    }
    m.group = *std::move(group);
    m.generation = r.generation;
  } else if (!named) {
    return out;
  }
  out.took_part = true;
  auto it = m.executors.find(r.checkpoint);
  if (it == m.executors.end()) {
    auto made = make_generation_executor({.world = m.group,
                                          .receiver = m.receiver.get(),
                                          .mode = r.mode,
                                          .bucket_bytes = r.bucket_bytes,
                                          .timeout = m.options.timeout});
    if (!made.ok()) {
      WL_RETURN_IF_ERROR(m.recover());
      return made.status().with_context("receiver " + std::to_string(m.options.id) +
                                        ": planning round " + std::to_string(r.round));
    }
    it = m.executors.emplace(r.checkpoint, *std::move(made)).first;
  }
  Result<UpdateReport> report =
      it->second->update({.checksums = r.checksums, .timeout = m.options.timeout});
  if (!report.ok()) {
    WL_RETURN_IF_ERROR(m.recover());
    return report.status().with_context("receiver " + std::to_string(m.options.id) + ": round " +
                                        std::to_string(r.round));
  }
  out.report = *report;
  out.version = m.receiver->version();
  return out;
}

Status FleetReceiver::leave() { return impl_->announce(true); }

}  // namespace wl::transfer
