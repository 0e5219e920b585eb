// FleetReceiver: the receiver side of the fleet protocol (fleet/protocol.h).
#include "weightlift/transfer/fleet/fleet_receiver.h"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <thread>

#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/core/mutex.h"
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

  uint64_t next_round = 1;  // in the store
  uint64_t generation = 0;  // the one this receiver is connected to (0: none)
  std::shared_ptr<comm::Group> group;
  std::map<std::string, std::unique_ptr<UpdateExecutor>> executors;  // by checkpoint
  std::atomic<bool> member{false};  // joined and not left (leave() may run beside serve_one())
  // leave() runs beside serve_one() in some callers (Python's threads), and the worker is for
  // one thread: whoever holds `serving` sends the leave notice that `leave_notice` asks for.
  Mutex serving;
  std::atomic<bool> leave_notice{false};
  void send_leave_notice();
  std::optional<Status> refused;  // turned away by the servers: every later call fails so
  bool rejoin = false;            // dropped, and our announcement to come back failed

  Status announce(bool leave);
  Status publish_peer_record();
  // After a failed round: drops the generation and, if the worker became unusable
  // (transport.h), moves the receiver's memory to a new one.
  Status recover();
  // Copies the fleet's current version from a peer of our shard or the servers' copy, if
  // either can give it; an error when the store fails or holds a damaged record, or when
  // the servers' copy cannot be read (heal_from_the_servers()).
  Status heal();
  Result<std::vector<int>> live_peer_ids();
  // The records of the live peers of our shard that are members of the fleet's current
  // generation (all of our shard before the first update).
  Result<std::vector<PeerRecord>> current_peers();
  // `here`: from the peers on this host, or from the others.
  Result<bool> heal_from_a_peer(const std::vector<PeerRecord>& peers, bool here);
  Status heal_from_the_servers();
  Result<comm::Bytes> wait_for(const std::string& key, comm::Deadline deadline);
  // The next round for us: the store's next one or, while we are connected to a generation,
  // a replay over its group, whichever comes first (protocol.h).
  Result<RoundRecord> next_round_record(comm::Deadline deadline);
  Result<RoundRecord> take_replay();
  Result<RoundOutcome> serve_one(std::chrono::milliseconds wait);
  Status answer(const RoundRecord& r, bool named, RoundOutcome& out);
  // `index`: ours among the round's members, or -1.
  Result<bool> enter_generation(const RoundRecord& r, int index);
  Status take_part(const RoundRecord& r, RoundOutcome& out);
};

FleetReceiver::FleetReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FleetReceiver::~FleetReceiver() = default;

Receiver& FleetReceiver::receiver() { return *impl_->receiver; }
uint64_t FleetReceiver::healed_version() const { return impl_->healed; }
std::string FleetReceiver::heal_log() const { return impl_->heal_log; }

Status FleetReceiver::Impl::announce(bool leave) {
  WL_ASSIGN_OR_RETURN(int64_t k, options.store->add(keys.joins(), 1));
  JoinRecord j{options.id, receiver->epoch(), leave};
  if (!leave) {
    const comm::ProcessId me = comm::this_process();
    const ReceiverOptions& o = receiver->options();
    j.host = me.host;
    j.pid = me.pid;
    j.tp = o.tp;
    j.tp_rank = o.tp_rank;
    j.ep = o.ep;
    j.ep_rank = o.ep_rank;
    j.format = std::string(weight_format_name(o.format));
    for (const ReceiverEntry& e : receiver->entries())
      j.tensors.push_back(tensor_signature(e.spec));
  }
  WL_RETURN_IF_ERROR(options.store->set(keys.join(k), comm::to_bytes(join_to_json(j))));
  member = !leave;
  return ok_status();
}

// The ids of receivers that joined and did not leave since, by their latest join record.
Result<std::vector<int>> FleetReceiver::Impl::live_peer_ids() {
  WL_ASSIGN_OR_RETURN(int64_t total, options.store->add(keys.joins(), 0));
  std::map<int, bool> left;  // id -> whether its latest record says it left
  for (int64_t k = 1; k <= total; ++k) {
    WL_ASSIGN_OR_RETURN(std::optional<JoinRecord> j,
                        read_join(*options.store, keys, k, std::min(options.timeout, kJoinGrace)));
    if (j && j->id != options.id) left[j->id] = j->leave;  // none: never written
  }
  std::vector<int> ids;
  for (const auto& [id, gone] : left) {
    if (!gone) ids.push_back(id);
  }
  return ids;
}

namespace {

// The members of the fleet's current generation: those of the last update posted in the store
// (its replays go to the same members); none before the first update.
Result<std::optional<std::vector<FleetMember>>> current_members(comm::Store& store,
                                                                const FleetKeys& keys) {
  WL_ASSIGN_OR_RETURN(const uint64_t last, last_round_posted(store, keys));
  for (uint64_t n = last; n > 0; --n) {
    WL_ASSIGN_OR_RETURN(comm::Bytes b, store.get(keys.round(n), std::chrono::milliseconds(0)));
    WL_ASSIGN_OR_RETURN(RoundRecord r, round_from_json(comm::to_string(b), keys.round(n)));
    if (r.kind == RoundRecord::Kind::kUpdate) return std::optional(std::move(r.members));
  }
  return std::optional<std::vector<FleetMember>>();
}

}  // namespace

// A peer the fleet left behind (it missed updates: its host was cut off, say, and is back) may
// still be alive and serving reads, and a copy of its version would leave us behind the fleet
// too (turned away as lagging at the next update, half the time); starting fresh is no worse
// than that. So only
// members of the current generation are healed from. A record the store cannot give or that
// is damaged is an error.
Result<std::vector<PeerRecord>> FleetReceiver::Impl::current_peers() {
  WL_ASSIGN_OR_RETURN(const std::vector<int> ids, live_peer_ids());
  WL_ASSIGN_OR_RETURN(const auto members, current_members(*options.store, keys));
  const std::string mine = layout_fingerprint(*receiver);
  std::vector<PeerRecord> peers;
  for (int id : ids) {
    Result<comm::Bytes> b = options.store->get(keys.peer(id), std::chrono::milliseconds(1));
    if (!b.ok() && b.status().code() == StatusCode::kDeadlineExceeded) continue;  // none yet
    if (!b.ok()) return b.status().with_context("reading " + keys.peer(id));
    WL_ASSIGN_OR_RETURN(PeerRecord peer, peer_record_from_json(comm::to_string(*b), keys.peer(id)));
    if (peer.fingerprint != mine) continue;  // another shard: nothing to copy from it
    if (members && std::none_of(members->begin(), members->end(), [&](const FleetMember& m) {
          return m.id == id && m.epoch == peer.epoch;
        })) {
      heal_log += peer.name +
                  " is not a member of the fleet's current generation (it missed "
                  "updates, or has not joined one yet): passed over\n";
      continue;
    }
    peers.push_back(std::move(peer));
  }
  return peers;
}

// One of `peers` (on this host or not, as `here` says) at the newest version they hold,
// copied: each is asked its version first, and the newest are tried in turn (one may be mid-
// update behind the others). A peer that cannot be healed from (gone, silent, mid-update) is
// noted in the log and passed over.
Result<bool> FleetReceiver::Impl::heal_from_a_peer(const std::vector<PeerRecord>& peers,
                                                   bool here) {
  const uint64_t this_host = comm::this_process().host;
  const comm::Deadline deadline = comm::deadline_after(options.heal_options.timeout);
  std::vector<std::pair<uint64_t, OpenPeer>> found;  // version, peer
  for (const PeerRecord& peer : peers) {
    if ((peer.host == this_host) != here) continue;
    Result<OpenPeer> open = open_peer(*worker, *receiver, peer);
    Result<uint64_t> v =
        open.ok()
            ? published_version(
                  *worker, *open,
                  std::min(deadline, comm::deadline_after(options.heal_options.probe_timeout)))
            : Result<uint64_t>(open.status());
    if (!v.ok()) {
      heal_log += v.status().to_string() + "\n";
    } else if (*v > 0) {
      found.emplace_back(*v, *std::move(open));
    }
  }
  std::stable_sort(found.begin(), found.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  for (const auto& [version, peer] : found) {
    if (version < found.front().first) {
      heal_log += peer.record.name + " holds version " + std::to_string(version) +
                  ", older than another peer's " + std::to_string(found.front().first) +
                  ": passed over\n";
      continue;
    }
    HealOptions left = options.heal_options;
    left.timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - comm::Clock::now());
    if (left.timeout <= std::chrono::milliseconds(0)) break;
    Result<uint64_t> v = heal_from_peer(*worker, *receiver, peer, left);
    if (v.ok()) {
      healed = *v;
      heal_log += "healed version " + std::to_string(*v) + " from " + peer.record.name + "\n";
      return true;
    }
    heal_log += v.status().to_string() + "\n";
  }
  return false;
}

// With no peer of our shard: from the servers' copy of the last checkpoint sent. We start
// fresh, and the next update brings the version, when there is no copy yet (NotFound: no
// update has happened), when the copy is not the version its records name
// (FailedPrecondition: the servers changed it since, an update is under way, or they withdrew
// it), and when the servers cannot be read now (Unavailable, DeadlineExceeded: a server gone
// whose record remains, a trainer too busy to serve), as healing from a peer does. What is
// wrong rather than passing (a damaged shard or record, a layout the checkpoint cannot
// produce) is returned.
Status FleetReceiver::Impl::heal_from_the_servers() {
  Result<std::vector<ServerCopyRecord>> records = read_server_copies(*options.store, keys);
  if (!records.ok()) {
    if (records.status().code() != StatusCode::kNotFound) return records.status();
    heal_log += records.status().to_string() + "\n";
    return ok_status();
  }
  Result<uint64_t> v = heal_from_servers(*worker, *receiver, *records, options.heal_options);
  if (!v.ok()) {
    const StatusCode code = v.status().code();
    if (code != StatusCode::kFailedPrecondition && code != StatusCode::kUnavailable &&
        code != StatusCode::kDeadlineExceeded) {
      return v.status();
    }
    heal_log += v.status().to_string() + "\n";
    return ok_status();
  }
  healed = *v;
  heal_log += "healed version " + std::to_string(*v) + " from the servers' copy of '" +
              records->front().checkpoint + "'\n";
  return ok_status();
}

// Peers on this host first, then the servers' copy, then peers on other hosts. Over TCP a
// one-sided read from another host moves only while the peer progresses its worker, which a
// peer busy elsewhere (a rollout worker generating, or waiting for its next command) does not;
// a read that times out is abandoned and its connection closed under the peer, and UCX 1.13
// can crash the peer when it next progresses (a segfault in its TCP transport, seen on the
// testbed). The servers' copy is read from a trainer that progresses while it waits for this
// receiver, and a peer on this host is read through shared memory with no help from it.
Status FleetReceiver::Impl::heal() {
  WL_ASSIGN_OR_RETURN(const std::vector<PeerRecord> peers, current_peers());
  WL_ASSIGN_OR_RETURN(const bool healed_here, heal_from_a_peer(peers, /*here=*/true));
  if (healed_here) return ok_status();
  WL_RETURN_IF_ERROR(heal_from_the_servers());
  if (healed > 0) return ok_status();
  return heal_from_a_peer(peers, /*here=*/false).status();
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
  WL_ASSIGN_OR_RETURN(const uint64_t posted, last_round_posted(*o.store, impl->keys));
  impl->next_round = posted + 1;
  if (o.heal) WL_RETURN_IF_ERROR(impl->heal().with_context(name + ": healing at start"));
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

Result<RoundRecord> FleetReceiver::Impl::next_round_record(comm::Deadline deadline) {
  const std::string key = keys.round(next_round);
  if (group == nullptr) {
    WL_ASSIGN_OR_RETURN(comm::Bytes b, wait_for(key, deadline));
    return round_from_json(comm::to_string(b), key);
  }
  // A replay usually follows right after whatever told us to expect one: spin on the group
  // first, then nap between looks, longer once idle for long (protocol.h).
  // The store is read first after kStoreCheck (or at the deadline): a read costs a round trip,
  // during which a replay that arrives waits.
  const comm::Clock::time_point start = comm::Clock::now();
  comm::Clock::time_point store_due = start + kStoreCheck;
  for (;;) {
    while (worker->progress()) {
    }
    if (group->probe(0, kReplayLengthTag)) return take_replay();
    if (leave_notice.exchange(false)) send_leave_notice();
    const comm::Clock::time_point now = comm::Clock::now();
    const bool last = now >= deadline;
    if (now >= store_due || last) {
      auto b = options.store->get(key, std::chrono::milliseconds(0));
      if (b.ok()) return round_from_json(comm::to_string(*b), key);
      if (b.status().code() != StatusCode::kDeadlineExceeded) return b.status();
      store_due = comm::Clock::now() + kStoreCheck;
    }
    if (last) {
      return deadline_exceeded("receiver " + std::to_string(options.id) +
                               ": no round posted under '" + key + "' yet, nor generation " +
                               std::to_string(generation) + "'s next update");
    }
    if (now - start < kReplaySpin) {
      std::this_thread::yield();
      continue;
    }
    const auto nap =
        std::chrono::nanoseconds(now - start < kReplayDoze ? kReplayNap : kReplayDozeNap);
    const timespec t{0, long(std::min(nap, std::chrono::nanoseconds(deadline - now)).count())};
    nanosleep(&t, nullptr);
  }
}

Result<RoundRecord> FleetReceiver::Impl::take_replay() {
  const std::string where = "receiver " + std::to_string(options.id) + ": generation " +
                            std::to_string(generation) + "'s replay from server rank 0";
  // Whatever goes wrong leaves this generation: its servers then fail the update on us, and
  // the next generation starts clean.
  auto failed = [&](Status why) -> Status {
    WL_RETURN_IF_ERROR(recover());
    return why.with_context(where);
  };
  uint64_t length = 0;
  Status got = group->recv({.data = &length,
                            .bytes = sizeof length,
                            .peer = 0,
                            .tag = kReplayLengthTag,
                            .timeout = options.timeout});
  if (!got.ok()) return failed(got);
  constexpr uint64_t kLongest = uint64_t(1) << 20;  // a replay names no members: ~300 bytes
  if (length > kLongest) return failed(data_loss(std::to_string(length) + " bytes long"));
  std::string body(size_t(length), '\0');
  got = group->recv({.data = body.data(),
                     .bytes = body.size(),
                     .peer = 0,
                     .tag = kReplayTag,
                     .timeout = options.timeout});
  if (!got.ok()) return failed(got);
  Result<RoundRecord> r = round_from_json(body, "the record");
  if (!r.ok()) return failed(r.status());
  if (r->kind != RoundRecord::Kind::kUpdate || r->replay == 0 || r->generation != generation) {
    return failed(data_loss("not an update of this generation (generation " +
                            std::to_string(r->generation) + ", replay " +
                            std::to_string(r->replay) + ")"));
  }
  return r;
}

// A form round: answer with our epoch and version if we are a candidate.
Status FleetReceiver::Impl::answer(const RoundRecord& r, bool named, RoundOutcome& out) {
  if (!named || !member) return ok_status();
  const std::string ack =
      std::to_string(receiver->epoch()) + " " + std::to_string(receiver->version());
  WL_RETURN_IF_ERROR(
      options.store->set(keys.ack(r.round, options.id, receiver->epoch()), comm::to_bytes(ack)));
  out.took_part = true;
  return ok_status();
}

// An update round of a generation we are not connected to: connect if it names us. Returns
// whether we are now a member of it.
Result<bool> FleetReceiver::Impl::enter_generation(const RoundRecord& r, int index) {
  executors.clear();
  group.reset();
  generation = 0;
  if (index < 0) {
    // Left out of a new generation while we think we belong: the servers dropped us (we
    // answered too late, they thought us dead, or we hold a version the next update cannot
    // bring us to: protocol.h). Announce again for the next one; an announcement that fails
    // (the store not reachable yet) is made again at the next serve_one().
    if (member) {
      rejoin = true;
      WL_RETURN_IF_ERROR(announce(false));
      rejoin = false;
    }
    return false;
  }
  auto joined = comm::Group::connect(
      fleet_connect_options(keys, keys.generation(r.generation), options.store, worker,
                            r.servers + index, r.servers + int(r.members.size()), options.timeout));
  if (!joined.ok()) {
    WL_RETURN_IF_ERROR(recover());
    return joined.status().with_context("receiver " + std::to_string(options.id) +
                                        ": joining generation " + std::to_string(r.generation));
  }
  group = *std::move(joined);
  generation = r.generation;
  return true;
}

// Our part of an update round: the checkpoint's executor (planned on first use in this
// generation), then the update itself.
Status FleetReceiver::Impl::take_part(const RoundRecord& r, RoundOutcome& out) {
  const std::string who = "receiver " + std::to_string(options.id);
  auto it = executors.find(r.checkpoint);
  if (it == executors.end()) {
    auto made = make_generation_executor({.world = group,
                                          .receiver = receiver.get(),
                                          .mode = r.mode,
                                          .bucket_bytes = r.bucket_bytes,
                                          .timeout = options.timeout});
    if (!made.ok()) {
      WL_RETURN_IF_ERROR(recover());
      return made.status().with_context(who + ": planning round " + std::to_string(r.round));
    }
    it = executors.emplace(r.checkpoint, *std::move(made)).first;
  }
  Result<UpdateReport> report =
      it->second->update({.checksums = r.checksums, .timeout = options.timeout});
  if (!report.ok()) {
    WL_RETURN_IF_ERROR(recover());
    return report.status().with_context(who + ": round " + std::to_string(r.round));
  }
  out.report = *report;
  out.version = receiver->version();
  return ok_status();
}

Result<RoundOutcome> FleetReceiver::serve_one(std::chrono::milliseconds wait) {
  Impl& m = *impl_;
  Result<RoundOutcome> out = [&] {
    const MutexLock hold(m.serving);
    if (m.leave_notice.exchange(false)) m.send_leave_notice();
    return m.serve_one(wait);
  }();
  // A leave() that found us serving left its notice to us; we may have passed our last look.
  if (m.leave_notice.load() && m.serving.try_lock()) {
    const MutexLock hold(m.serving, std::adopt_lock);
    if (m.leave_notice.exchange(false)) m.send_leave_notice();
  }
  return out;
}

Result<RoundOutcome> FleetReceiver::Impl::serve_one(std::chrono::milliseconds wait) {
  Impl& m = *this;
  if (m.refused) return *m.refused;
  if (m.rejoin) {
    WL_RETURN_IF_ERROR(m.announce(false));
    m.rejoin = false;
  }
  WL_ASSIGN_OR_RETURN(RoundRecord r, m.next_round_record(comm::deadline_after(wait)));
  if (r.replay == 0) ++m.next_round;
  RoundOutcome out{
      .round = r.round, .replay = r.replay, .kind = r.kind, .version = m.receiver->version()};
  auto me = std::find_if(r.members.begin(), r.members.end(), [&](const FleetMember& f) {
    return f.id == m.options.id && f.epoch == m.receiver->epoch();
  });
  // A replay comes to members only, and names none.
  const int index = r.replay > 0 ? 0 : me == r.members.end() ? -1 : int(me - r.members.begin());
  if (r.kind == RoundRecord::Kind::kForm) {
    WL_RETURN_IF_ERROR(m.answer(r, index >= 0, out));
    return out;
  }
  if (r.kind == RoundRecord::Kind::kRefuse) {
    for (const Refusal& x : r.refused) {
      if (x.receiver.id != m.options.id || x.receiver.epoch != m.receiver->epoch()) continue;
      m.member = false;
      m.refused = Status(StatusCode::kPermissionDenied,
                         "receiver " + std::to_string(m.options.id) +
                             " was turned away by the parameter server: " + x.reason);
      return *m.refused;
    }
    return out;
  }
  if (r.generation != m.generation) {
    out.left_behind =
        std::find(r.lagging.begin(), r.lagging.end(), m.options.id) != r.lagging.end();
    WL_ASSIGN_OR_RETURN(bool in, m.enter_generation(r, index));
    if (!in) return out;
  } else if (index < 0) {
    return out;
  }
  out.took_part = true;
  WL_RETURN_IF_ERROR(m.take_part(r, out));
  return out;
}

// After the leave record: an update that names us looks in the store because of this notice,
// and must find it there. Best effort: without it such an update fails on us instead.
void FleetReceiver::Impl::send_leave_notice() {
  if (group == nullptr) return;
  const uint64_t epoch = receiver->epoch();
  (void)group->send({.data = &epoch,
                     .bytes = sizeof epoch,
                     .peer = 0,
                     .tag = kLeaveTag,
                     .timeout = std::chrono::milliseconds(1000)});
}

Status FleetReceiver::leave() {
  Impl& m = *impl_;
  WL_RETURN_IF_ERROR(m.announce(true));
  m.leave_notice = true;
  if (m.serving.try_lock()) {  // else serve_one() sends it
    const MutexLock hold(m.serving, std::adopt_lock);
    if (m.leave_notice.exchange(false)) m.send_leave_notice();
  }
  return ok_status();
}

}  // namespace wl::transfer
