// The fleet: parameter-server ranks and receivers that come and go, coordinated through the
// rendezvous store. The parameter server (fleet/parameter_server.h) drives; receivers
// (fleet/fleet_receiver.h) follow. This file is the protocol both sides speak.
//
// Rounds. The parameter server's rank 0 numbers the rounds it posts in the store 1, 2, ... and
// posts each as a record under "<prefix>/round/<n>", then counts it in "<prefix>/rounds".
// Three kinds:
//   form    a new generation g of the fleet: the candidate receivers. Each candidate that is
//           alive answers under "<prefix>/round/<n>/ack/<id>/<epoch>" with "<epoch> <version>"
//           (two receivers may contend for an id: a restart and the holder); whoever
//           has not answered within the join timeout is left out (a dead or frozen receiver
//           costs one join timeout, once), and so is whoever holds a version the next update
//           cannot bring it to (transfer/modes/update_executor.h, can_take_next_version):
//           members hold the newest version among the answers, nothing, or one behind it by an
//           even number. Every update moves every byte, into the slot a member does not serve
//           from, so a fresh receiver (version 0: it started and could heal neither from a
//           peer of its shard nor from the servers' copy) and one that missed updates (its
//           host was cut off and came back) get the whole next version from the servers. One
//           behind by an odd number serves from that slot: it is left out as lagging,
//           announces itself again, and the generation formed after the next update takes it.
//           Then every member connects the group
//           "<prefix>/gen/<g>": parameter-server ranks first, then the members in the listed
//           order, all on the worker they keep for their whole life (so receiver memory stays
//           registered).
//   update  generation g moves checkpoint `checkpoint` in `mode` to its members. A checkpoint
//           the generation has not moved before is planned first (plan_transfer: metadata
//           gathered once per generation and checkpoint), then the executor runs.
// A new generation is formed when receivers joined or left since the last one, when the
// caller asks for another set of receivers, or after a failed round (a failed round breaks
// its group: transport.h). Receivers a round does not name skip it.
//
// Replays. Only the first update of a generation is posted in the store. The ones after it
// (the same members, nothing failed) go from server rank 0 to each member over the
// generation's own group: the same record without its member list, with the number of the
// last store round and `replay` 1, 2, ..., as a u64 length (user tag kReplayLengthTag) and
// the JSON (kReplayTag).
// So the steady state of a fleet, one update per training step to the same receivers, costs
// the store nothing: a store round trip is a wake-up of the store's process, about 100 us on
// 2 busy cores, and was half of a small model's update (docs/BENCHMARKS.md). A member waits
// for both: its group, and the store every kStoreCheck, which is where every round that
// changes the fleet comes. An update that names its receivers, when they are the
// generation's members in its order, reads no join records either: a receiver that joins
// meanwhile is seen at the next update that reads them (one that takes everyone who joined,
// names others, or follows a failure), and one contending for a member's id then too. A member
// that leaves also tells server rank 0 over the group (kLeaveTag), so that such an update
// reads the joins after all and finds the leave.
//
// Joining and leaving. A receiver announces itself by appending a record {id, epoch, leave,
// its process and its layout} under "<prefix>/join/<k>" (k from the counter "<prefix>/joins");
// a restarted receiver announces again with its new epoch.
//   refuse  the server's rank 0 turns a receiver away, naming why: its id is held by a
//           receiver that has not left and whose process is alive (or cannot be known to be
//           dead: another host), or its layout is not the inference layout of the checkpoint
//           an update moves (checked as the planner would, before any generation is formed
//           with it). The refused receiver's serve_one() fails with that reason
//           (PermissionDenied) from then on;
//           the others go on as if it had never joined. Healthy receivers also leave a PeerRecord
//           under
// "<prefix>/peer/<id>" so that restarted ones can heal from them (fleet/heal_from_peer.h); server
// ranks leave a ServerCopyRecord under "<prefix>/copy/<rank>" for those with no such peer
// (fleet/heal_from_servers.h).
//
// Every record is JSON with a format_version; docs/formats.md, "Fleet records".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/json_record.h"
#include "weightlift/core/status.h"
#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

// Every fleet record is versioned JSON (core/json_record.h); version 2: records name their
// format ("format"). Round records are at version 3: replays. `name` is "weightlift-fleet-<kind>".
constexpr RecordFormat fleet_record(std::string_view name, std::string_view what, int version = 2) {
  return {.name = name,
          .version = version,
          .what = what,
          .remedy = "run one weightlift version across the fleet"};
}

struct FleetMember {
  int id = 0;          // the receiver's id, chosen by whoever starts it; unique in the fleet
  uint64_t epoch = 0;  // Receiver::epoch(): a new one every start
};

// A receiver turned away (a refuse round's), and why.
struct Refusal {
  FleetMember receiver;
  std::string reason;
};

struct RoundRecord {
  enum class Kind : uint8_t { kForm, kUpdate, kRefuse };
  Kind kind = Kind::kUpdate;
  uint64_t round = 0;
  uint64_t generation = 0;
  int servers = 0;                   // parameter-server ranks: ranks 0 .. servers-1
  std::vector<FleetMember> members;  // form: the candidates; update: the group, in rank order
  // update rounds that formed a generation: candidates left out because they hold a version
  // an odd number behind the others (they missed updates); they announce themselves again.
  std::vector<int> lagging;
  std::vector<int> dropped;  // every candidate left out: lagging, or silent past the timeout
  std::string checkpoint;    // update only
  TransferMode mode = TransferMode::kP2P;
  int64_t bucket_bytes = 0;      // broadcast mode's bucket size
  bool checksums = false;        // p2p's per-task checksums (every rank must agree)
  std::vector<Refusal> refused;  // refuse only
  // 0: posted in the store as round `round`. n > 0: generation `generation`'s n-th replay
  // (above), sent over its group after store round `round` (its first update, or a refuse
  // round posted since), without `members`.
  uint64_t replay = 0;
};

struct JoinRecord {
  int id = 0;
  uint64_t epoch = 0;
  bool leave = false;
  // A join's: the receiver's process (comm::this_process()), and what it holds: its TP rank,
  // format and tensors ("name:dtype[d0,d1]" each), for the server to check against a
  // checkpoint's inference layout before planning with it.
  uint64_t host = 0;
  int64_t pid = 0;
  int tp = 1, tp_rank = 0, ep = 1, ep_rank = 0;
  std::string format = "bf16";
  std::vector<std::string> tensors;
};

std::string round_to_json(const RoundRecord& r);
Result<RoundRecord> round_from_json(std::string_view json, std::string_view where);
std::string join_to_json(const JoinRecord& j);
// "name:dtype[d0,d1]": a receiver tensor as join records list it.
std::string tensor_signature(const ReceiverTensorSpec& t);
Result<JoinRecord> join_from_json(std::string_view json, std::string_view where);

// The store keys of the top comment.
struct FleetKeys {
  std::string prefix;
  std::string rounds() const { return prefix + "/rounds"; }
  std::string round(uint64_t n) const { return prefix + "/round/" + std::to_string(n); }
  std::string ack(uint64_t n, int id, uint64_t epoch) const {
    return round(n) + "/ack/" + std::to_string(id) + "/" + std::to_string(epoch);
  }
  std::string joins() const { return prefix + "/joins"; }
  std::string join(int64_t k) const { return prefix + "/join/" + std::to_string(k); }
  std::string peer(int id) const { return prefix + "/peer/" + std::to_string(id); }
  std::string generation(uint64_t g) const { return prefix + "/gen/" + std::to_string(g); }
  std::string servers() const { return prefix + "/servers"; }  // the servers' own group
  std::string copy(int server_rank) const {                    // fleet/heal_from_servers.h
    return prefix + "/copy/" + std::to_string(server_rank);
  }
  std::string group_ids() const { return prefix + "/group_ids"; }
};

// How long a counted join slot ("<prefix>/join/<k>") may stay empty before a reader passes
// it over: a receiver writes its record right after it counts the slot, unless the count's
// reply never reached it (a link cut then), and then the record never comes.
inline constexpr std::chrono::milliseconds kJoinGrace{1000};

// User tags of the messages of a generation's group: a replay (server rank 0 to each member)
// and a member's leave (to server rank 0).
inline constexpr uint32_t kReplayLengthTag = 0x7d0, kReplayTag = 0x7d1, kLeaveTag = 0x7d2;
// A member waiting for a round spins on its group for kReplaySpin (a replay usually follows
// right after whatever told it to expect one), then naps between looks at its group, for
// kReplayNap until it has waited kReplayDoze and for kReplayDozeNap after that (an idle
// receiver wakes a thousand times a second, not twenty thousand), and reads the store's next
// round, without waiting, every kStoreCheck (what a receiver's wait cost the store before
// replays).
inline constexpr std::chrono::milliseconds kStoreCheck{10};
inline constexpr std::chrono::milliseconds kReplaySpin{2};
inline constexpr std::chrono::microseconds kReplayNap{50};
inline constexpr std::chrono::milliseconds kReplayDoze{100};
inline constexpr std::chrono::microseconds kReplayDozeNap{1000};

// Join record k ("<prefix>/join/<k>"), waiting up to `wait` for it; nullopt if it is not there
// by then (a slot counted but not written yet, or never: kJoinGrace). A store that fails or a
// damaged record is an error naming the key.
Result<std::optional<JoinRecord>> read_join(comm::Store& store, const FleetKeys& keys, int64_t k,
                                            std::chrono::milliseconds wait);

// The number of the last round posted in the store: the counter, then any rounds past it (a
// server that died between posting a round and counting it). Reads that do not wait.
Result<uint64_t> last_round_posted(comm::Store& store, const FleetKeys& keys);

// One checkpoint's executor in one generation, whichever the mode: plans (metadata gathered
// once) and makes the executor. Collective over `world`. Exactly one of `weights` (server
// ranks) and `receiver` is set.
struct GenerationExecutorOptions {
  std::shared_ptr<comm::Group> world;
  TrainerWeights* weights = nullptr;
  Receiver* receiver = nullptr;
  TransferMode mode = TransferMode::kP2P;
  int64_t bucket_bytes = 0;
  std::chrono::milliseconds timeout{0};
};
Result<std::unique_ptr<UpdateExecutor>> make_generation_executor(
    const GenerationExecutorOptions& options);

// The same store connection options for every group of the fleet: one worker for the
// process's whole life, group ids from one counter.
comm::ConnectOptions fleet_connect_options(const FleetKeys& keys, std::string group_prefix,
                                           std::shared_ptr<comm::Store> store,
                                           std::shared_ptr<comm::Transport> worker, int rank,
                                           int size, std::chrono::milliseconds timeout);

}  // namespace wl::transfer
