// Healing: a receiver that restarts (or joins late) copies its weights out of a healthy peer
// that holds the same shard, by one-sided gets, without the peer, the other receivers or the
// trainers doing anything. This is checkpoint-engine's "restarted engines pull from healthy
// ones", done with RDMA-style reads instead of a broadcast the whole fleet takes part in.
//
// A healthy receiver advertises a PeerRecord (its worker address, rkey, slot and status
// addresses, and a fingerprint of its layout) once in the store. The newcomer, whose layout
// has the same fingerprint, reads the peer's status block (layout/receiver.h: published version v
// and the version being written), gets slot v % 2 whole, then reads the status again: the copy is
// consistent unless a write of version v + 2 (the next one to reuse that slot) began meanwhile,
// in which case it tries again. Version v+1 may be written during the copy; it goes into the
// other slot. The newcomer then adopts v: it is on the same version as its peers and can take
// part in the next update like any of them.
//
// Transport: gets need no help from the peer on shared memory, CMA or RDMA. Over TCP UCX needs
// the peer to progress its worker; fleet receivers do so while they wait for the next round
// (fleet/protocol.h), so healing works there too, only slower.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/transport/transport.h"
#include "weightlift/core/status.h"
#include "weightlift/transfer/layout/receiver.h"

namespace wl::transfer {

// What a healthy receiver tells newcomers (JSON, in the store).
struct PeerRecord {
  std::string name;  // "receiver 3", for errors
  uint64_t epoch = 0;
  std::string fingerprint;  // layout_fingerprint(): equal fingerprints, byte-identical slots
  std::vector<std::byte> worker_address;
  std::vector<std::byte> rkey;  // packed
  uint64_t slot_address[2] = {0, 0};
  uint64_t slot_bytes = 0;
  uint64_t status_address = 0;
  uint64_t host = 0;  // comm::this_process() of the receiver, to skip one that has exited
  int64_t pid = 0;
};

// Names, dtypes, shapes, offsets and TP position: what must agree for a byte copy to be right.
std::string layout_fingerprint(const Receiver& receiver);

PeerRecord peer_record(const Receiver& receiver, std::string name);
std::string peer_record_to_json(const PeerRecord& record);
// DataLoss naming `where` for anything that is not a PeerRecord of this format version.
Result<PeerRecord> peer_record_from_json(std::string_view json, std::string_view where);

// Bytes per one-sided get while healing: requests of bounded size.
inline constexpr size_t kHealGetChunk = size_t(64) << 20;

struct HealOptions {
  std::chrono::milliseconds timeout{30000};  // for the whole heal, every wait included
  int attempts = 8;  // copies to try while the peer keeps rewriting the slot under us
  // For reading one peer's version before choosing whom to copy from: a peer that cannot
  // answer within it (its host cut off, its process stopped) is passed over.
  std::chrono::milliseconds probe_timeout{2000};
};

// A peer of our shard, connected and its rkey unpacked: ready to be read.
struct OpenPeer {
  PeerRecord record;
  int id = -1;  // the connection, on the worker that opened it
  comm::RemoteKey rkey;
};

// FailedPrecondition if the peer's layout is not `receiver`'s; Unavailable if its process has
// exited (on this host) or it cannot be connected.
Result<OpenPeer> open_peer(comm::Transport& worker, const Receiver& receiver,
                           const PeerRecord& peer);

// The version the peer has published (0: none yet).
Result<uint64_t> published_version(comm::Transport& worker, const OpenPeer& peer,
                                   comm::Deadline deadline);

// Copies the peer's published version into `receiver` and adopts it; returns that version.
// REQUIRES: receiver.version() == 0 and no reader yet (Receiver::slot_for_healing); `peer`
// opened by open_peer() for this receiver, on `worker`.
// FailedPrecondition if the peer holds nothing yet (version 0); Unavailable /
// DeadlineExceeded if the peer cannot be reached or dies; Aborted if every attempt raced with
// the peer's updates. Nothing is adopted on error.
Result<uint64_t> heal_from_peer(comm::Transport& worker, Receiver& receiver, const OpenPeer& peer,
                                const HealOptions& options = {});
// open_peer(), then the copy (its errors too).
Result<uint64_t> heal_from_peer(comm::Transport& worker, Receiver& receiver, const PeerRecord& peer,
                                const HealOptions& options = {});

}  // namespace wl::transfer
