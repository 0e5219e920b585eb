// Healing from a peer: the record it advertises, and the seqlock-style copy of
// fleet/heal_from_peer.h.
#include "weightlift/transfer/fleet/heal_from_peer.h"

#include <algorithm>
#include <cstring>

#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/transfer/fleet/protocol.h"
#include "weightlift/transfer/plan/metadata.h"

namespace wl::transfer {
namespace {

constexpr RecordFormat kPeerFormat = fleet_record("weightlift-fleet-peer", "fleet peer record");

using json = nlohmann::json;

struct PeerStatus {
  uint64_t published = 0;
  uint64_t writing = 0;
};

}  // namespace

std::string layout_fingerprint(const Receiver& r) {
  const ReceiverOptions& o = r.options();
  // EP only when there is some: a peer of a build before EP engines has the same fingerprint.
  std::string f = "tp " + std::to_string(o.tp) + " rank " + std::to_string(o.tp_rank) +
                  (o.ep > 1 ? " ep " + std::to_string(o.ep) + " rank " + std::to_string(o.ep_rank)
                            : std::string()) +
                  " " + std::string(weight_format_name(o.format)) + " slot " +
                  std::to_string(r.slot_bytes());
  for (const ReceiverEntry& e : r.entries()) {
    f += ";" + e.spec.name + ":" + std::string(dtype_name(e.spec.dtype)) + "[";
    for (int64_t d : e.spec.shape) f += std::to_string(d) + ",";
    f += "]@" + std::to_string(e.offset);
  }
  return f;
}

PeerRecord peer_record(const Receiver& r, std::string name) {
  PeerRecord p;
  p.name = std::move(name);
  p.epoch = r.epoch();
  p.fingerprint = layout_fingerprint(r);
  p.worker_address = r.worker_address();
  p.rkey = r.packed_rkey();
  p.slot_address[0] = r.slot_address(0);
  p.slot_address[1] = r.slot_address(1);
  p.slot_bytes = r.slot_bytes();
  p.status_address = r.status_address();
  const comm::ProcessId self = comm::this_process();
  p.host = self.host;
  p.pid = self.pid;
  return p;
}

std::string peer_record_to_json(const PeerRecord& p) {
  json j = new_record(kPeerFormat);
  j["name"] = p.name;
  j["epoch"] = p.epoch;
  j["fingerprint"] = p.fingerprint;
  endpoint_to_json(p.worker_address, p.rkey, j);
  j["slot_address"] = {p.slot_address[0], p.slot_address[1]};
  j["slot_bytes"] = p.slot_bytes;
  j["status_address"] = p.status_address;
  process_to_json(p.host, p.pid, j);
  return j.dump();
}

Result<PeerRecord> peer_record_from_json(std::string_view text, std::string_view where) {
  return read_record<PeerRecord>(text, where, kPeerFormat, [](const json& j) {
    PeerRecord p;
    p.name = j.at("name").get<std::string>();
    p.epoch = uint_field(j.at("epoch"));
    p.fingerprint = j.at("fingerprint").get<std::string>();
    endpoint_from_json(j, p.worker_address, p.rkey);
    p.slot_address[0] = uint_field(j.at("slot_address").at(0));
    p.slot_address[1] = uint_field(j.at("slot_address").at(1));
    p.slot_bytes = uint_field(j.at("slot_bytes"));
    p.status_address = uint_field(j.at("status_address"));
    process_from_json(j, p.host, p.pid);
    return p;
  });
}

Result<OpenPeer> open_peer(comm::Transport& worker, const Receiver& receiver,
                           const PeerRecord& peer) {
  const std::string who = "healing from " + peer.name;
  if (peer.fingerprint != layout_fingerprint(receiver) ||
      peer.slot_bytes != receiver.slot_bytes()) {
    return failed_precondition(who +
                               ": its weights are laid out differently (another TP or EP rank, "
                               "format or model); heal only from a receiver of the same shard");
  }
  if (!comm::process_may_be_alive({peer.host, peer.pid})) {
    return unavailable(who + ": its process (pid " + std::to_string(peer.pid) + ") has exited");
  }
  OpenPeer open{.record = peer};
  WL_ASSIGN_OR_RETURN(open.id, worker.connect(peer.worker_address, peer.name));
  WL_ASSIGN_OR_RETURN(open.rkey, worker.unpack_rkey(open.id, peer.rkey));
  return open;
}

namespace {

Result<PeerStatus> read_status(comm::Transport& worker, const OpenPeer& peer,
                               comm::Deadline deadline) {
  uint64_t words[2] = {0, 0};
  comm::Request r = worker.get(peer.id, words, sizeof words, peer.record.status_address, peer.rkey);
  WL_RETURN_IF_ERROR(
      worker.wait(r, deadline)
          .with_context("healing from " + peer.record.name + ": reading its status"));
  return PeerStatus{words[0], words[1]};
}

}  // namespace

Result<uint64_t> published_version(comm::Transport& worker, const OpenPeer& peer,
                                   comm::Deadline deadline) {
  WL_ASSIGN_OR_RETURN(PeerStatus status, read_status(worker, peer, deadline));
  return status.published;
}

Result<uint64_t> heal_from_peer(comm::Transport& worker, Receiver& receiver, const OpenPeer& peer,
                                const HealOptions& options) {
  const comm::Deadline deadline = comm::deadline_after(options.timeout);
  const std::string who = "healing from " + peer.record.name;
  for (int attempt = 0; attempt < options.attempts; ++attempt) {
    WL_ASSIGN_OR_RETURN(PeerStatus before, read_status(worker, peer, deadline));
    if (before.published == 0) {
      return failed_precondition(who + ": it holds no complete version yet");
    }
    const uint64_t v = before.published;
    std::span<std::byte> into = receiver.slot_for_healing(v);
    const uint64_t from = peer.record.slot_address[v % 2];
    std::vector<comm::Request> gets;
    for (size_t at = 0; at < into.size(); at += kHealGetChunk) {
      const size_t n = std::min(kHealGetChunk, into.size() - at);
      gets.push_back(worker.get(peer.id, into.data() + at, n, from + at, peer.rkey));
    }
    gets.push_back(worker.flush(peer.id));
    WL_RETURN_IF_ERROR(worker.wait_all(gets, deadline)
                           .with_context(who + ": copying version " + std::to_string(v)));
    WL_ASSIGN_OR_RETURN(PeerStatus after, read_status(worker, peer, deadline));
    // Slot v % 2 is rewritten only by version v + 2; anything below that left it alone.
    if (std::max(after.published, after.writing) < v + 2) {
      receiver.adopt(v);
      return v;
    }
  }
  return aborted(who + ": the peer moved on by two versions during each of " +
                 std::to_string(options.attempts) +
                 " copies; heal between updates or raise "
                 "attempts");
}

Result<uint64_t> heal_from_peer(comm::Transport& worker, Receiver& receiver, const PeerRecord& peer,
                                const HealOptions& options) {
  WL_ASSIGN_OR_RETURN(OpenPeer open, open_peer(worker, receiver, peer));
  return heal_from_peer(worker, receiver, open, options);
}

}  // namespace wl::transfer
