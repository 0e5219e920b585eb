// ParameterServer's state (fleet/parameter_server.h), shared by its two files:
// parameter_server.cc holds checkpoints and runs updates, server_rounds.cc decides each
// update's round (fleet/protocol.h). Not for other code.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/transfer/fleet/parameter_server.h"

namespace wl::transfer {
namespace fleet_detail {

// One checkpoint on this server rank: its shards, in `memory` when UCX could allocate it
// (fleet/heal_from_servers.h: [status | shards], readable by restarted receivers), else in the
// heap.
struct HeldCheckpoint {
  std::shared_ptr<comm::MemoryRegion> memory;        // from the first worker's allocation
  std::shared_ptr<comm::MemoryRegion> registration;  // with the current worker (may be `memory`)
  std::unique_ptr<TrainerWeights> weights;           // borrows `memory` (declared after it)
  uint64_t stamp = 0;                                // status word [1]
  // The copy record's last publication: the version sent and the stamp it was sent at. The
  // status block holds the current ones (words [2] and [3]).
  std::optional<std::pair<uint64_t, uint64_t>> published;

  uint64_t* status() const { return static_cast<uint64_t*>(memory->data()); }
};

}  // namespace fleet_detail

struct ParameterServer::Impl {
  using HeldCheckpoint = fleet_detail::HeldCheckpoint;

  ParameterServerOptions options;
  FleetKeys keys;
  std::shared_ptr<comm::Worker> worker;  // for the process's whole life
  std::shared_ptr<comm::Group> servers;  // the server ranks: full_tensor() gathers
  std::map<std::string, HeldCheckpoint> checkpoints;
  std::string copy_names;  // the checkpoint this rank's copy record names ("": none)

  // The current generation: its group and, per checkpoint, its executor.
  uint64_t generation = 0;
  std::vector<FleetMember> members;
  std::shared_ptr<comm::Group> group;
  std::map<std::string, std::unique_ptr<UpdateExecutor>> executors;  // by checkpoint
  bool broken = true;  // no generation yet, or its last update failed
  // After a failed update every server rank replaces its worker and reconnects the servers'
  // group: a transfer to a receiver that died may have made the worker unusable
  // (transport.h), and the server ranks must stay in step, so all of them do it.
  bool rebuild = false;
  int incarnation = 0;

  // Rank 0 only: the round counter. Who has joined: rank 0's drives updates; another rank's
  // is read only for joined_receivers().
  uint64_t round = 0;
  uint64_t counted = 0;  // the rounds the store's counter has counted
  uint64_t replays = 0;  // the generation's updates sent over its group since store round `round`
  int64_t joins_seen = 0;
  // Join slots counted but still empty when read (server_rounds.cc, kJoinGrace): looked at
  // again at each read.
  std::set<int64_t> missing_joins;
  std::map<int, uint64_t> joined;     // id -> epoch
  std::map<int, JoinRecord> holders;  // id -> the join record of joined[id]
  // Every receiver that has joined, by (id, epoch): its process, as its join record names it.
  std::map<std::pair<int, uint64_t>, comm::ProcessId> processes;
  // A receiver that joined with an id another epoch holds: a restart of a holder that died, or
  // a second receiver given the same id. The next form round asks both; the holder keeps the id
  // if it answers, else the contender takes it.
  std::map<int, JoinRecord> contenders;
  std::vector<Refusal> refusals;  // rank 0: turned away, to post in a refuse round
  // Rank 0: (receiver id, epoch, checkpoint) whose layouts agree, so that an update checks each
  // receiver once, not every time (a layout check of `medium` takes about 75 us). Cleared
  // whenever a checkpoint is held or let go.
  std::set<std::tuple<int, uint64_t, std::string>> fits;

  Status read_joins();
  void take_join(JoinRecord j);  // one join or leave record, in the order they are read
  // Rank 0: why `j`'s layout is not checkpoint `name`'s inference layout at its TP rank and
  // format (the planner's check, planner.cc), or "" when it is.
  std::string layout_mismatch(const std::string& name, const JoinRecord& j);
  // Rank 0: the refusals gathered since the last one, as a refuse round.
  Status post_refusals();
  Result<std::vector<FleetMember>> wanted(const std::string& name, std::span<const int> receivers);
  bool generation_broken();
  Status form(const std::string& name, const std::vector<FleetMember>& wanted, RoundRecord& update);
  // Rank 0: the version `j` answered form round `round_number` with; NotFound when it did not
  // by `deadline`, or is known to have exited.
  Result<uint64_t> ack_of(uint64_t round_number, const JoinRecord& j, comm::Deadline deadline);
  Result<std::vector<std::pair<FleetMember, uint64_t>>> answers(
      const std::string& name, const std::vector<FleetMember>& wanted, RoundRecord& update);
  Result<RoundRecord> decide(const std::string& name, std::span<const int> receivers,
                             bool checksums);
  // Rank 0: whether a member has told us it leaves (protocol.h), taking every such notice.
  bool members_leaving();
  // Rank 0: whether `receivers` are the generation's members in its order, each known to fit
  // `name`: an update to them then needs no join records (protocol.h, replays).
  bool names_the_members(const std::string& name, std::span<const int> receivers);
  Result<RoundRecord> post(RoundRecord r);
  // Rank 0: `r` as the next update of the current generation, sent over its group.
  RoundRecord replay(RoundRecord r);
  Status send_replay(const RoundRecord& r);
  Result<RoundRecord> share(Result<RoundRecord> decided);
  // Checkpoint `name`'s update to the current generation, as every server rank's call asks.
  RoundRecord generation_update(const std::string& name, bool checksums) const;
  // Rank 0: whether this update can be the generation's next replay: to the members it has,
  // nothing asking for more (protocol.h). It touches nothing outside this process; the
  // replay's number is taken once every server rank has come in (open_update()).
  bool can_replay(const std::string& name, std::span<const int> receivers);
  // Every update opens with one collective over the server ranks: whether each holds the
  // checkpoint (so that rank 0 acts only once all of them are in and can), and rank 0's
  // replay if it has one. Otherwise rank 0 decides, asking the store, and shares it.
  Result<RoundRecord> open_update(const std::string& name, bool holds,
                                  std::span<const int> receivers, bool checksums);
  // Every server rank's outcome of one step of an update, so that they fail it together:
  // `mine` where it failed here, else an error naming the highest server rank where it did.
  Status agree(Status mine, const std::string& what);
  Status enter_generation(const RoundRecord& r);
  // Connects the generation of `r` and plans `name`'s transfer in it (once per checkpoint).
  Status prepare(const std::string& name, TrainerWeights* weights, const RoundRecord& r);
  Status connect_servers();
  Status rebuild_worker();
  // Publishes the record of checkpoint `name`'s copy as of `version`, sent when its stamp was
  // `stamp` (a healer refuses the copy once the stamp has moved on).
  Status publish_copy(const std::string& name, uint64_t version, uint64_t stamp);
  // OK for a name not yet held.
  Status check_new(const std::string& name) const;
  // Holds a new checkpoint whose shards (`shard_bytes` of them) make(storage) builds
  // (storage may be null).
  void hold(const std::string& name, size_t shard_bytes,
            const std::function<TrainerWeights(std::byte* storage)>& make);
  size_t shard_bytes(const model::ModelConfig& config,
                     std::span<const RowSplit> splits = {}) const {
    return TrainerWeights::storage_bytes(config, options.size, options.rank, options.shard_dtype,
                                         splits);
  }
  // New values for a held checkpoint, written by assign() under the servers' copy's seqlock,
  // which begin_change() and end_change() are (heal_from_servers.h).
  static void assign(HeldCheckpoint& held, const std::function<void(TrainerWeights&)>& write);
  static void begin_change(HeldCheckpoint& held);
  static void end_change(HeldCheckpoint& held);
};

}  // namespace wl::transfer
