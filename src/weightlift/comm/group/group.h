// Group: a set of ranks that run collectives together, and the message tags that keep groups
// and operations apart.
//
// The world group is built by connect(): every rank publishes its UCX worker address in the
// store and connects to every other rank. split() carves sub-groups out of any group (by
// color, ordered by key, as MPI_Comm_split does); sub-groups share the world's worker and
// connections and get a job-wide unique id from the store.
//
// Tags. Every message carries a 64-bit UCX tag:
//     bits 63..44  group id (20 bits; the world is 0)
//     bits 43..24  sender's rank in the group (20 bits)
//     bit  23      1 for user send/recv, 0 for collectives
//     bits 22..16  collective sequence number, mod 128 (collectives only)
//     bits 15..0   step within the collective, mod 65536 (user send/recv: bits 22..0 are the
//                  user's tag)
// A receive names the exact tag, so messages of different groups, or of consecutive
// collectives on one group, cannot match each other; within one (sender, tag) UCX matches in
// send order, which is what makes the mod-2^k wrap harmless.
//
// On one host the collectives move data through a shared-memory arena the group sets up on
// first use (detail/shm_arena.h, allreduce_shm.cc); between hosts, through tagged messages.
//
// Every operation has a deadline: its options' timeout, or the group's default when that is
// zero. After a failed operation the connections it used are closed (transport.h), so the
// group is broken; make a new one.
//
// REQUIRES: a group and all groups split from it are used from one thread at a time, and
// every member calls collectives on a group in the same order.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/comm/store/store.h"
#include "weightlift/comm/transport/transport.h"

namespace wl::comm {

struct ConnectOptions {
  std::shared_ptr<Store> store;  // shared with sub-groups, which need it to split
  int rank = 0;
  int size = 1;
  WorkerOptions worker;  // an empty worker.name becomes "rank <rank>"
  // Deadline for connecting, and the default for every operation on the group and its
  // sub-groups.
  std::chrono::milliseconds timeout{30000};
  // Prefix of this job's keys in the store, so that several worlds can share one store.
  std::string prefix = "wl";
  // Connect through this transport instead of creating a UCX worker: several worlds made over
  // time (a fleet whose membership changes between weight updates) then share one worker, and
  // memory registered with it stays valid for all of them; a test passes a FaultTransport
  // (fault_transport.h). Every world on a shared transport, and every group split from one,
  // draws its id from the counter `ids_key` in the store so that their tags never meet; pass
  // the same ids_key to every such world. Null: a worker of its own.
  std::shared_ptr<Transport> transport;
  std::string ids_key;  // required with transport; else "<prefix>/next_group_id"
  // The host this rank counts as, for the collectives that treat the ranks of one host
  // together (the hierarchical allreduce); 0: the one it runs on, this_host(). Tests of
  // those collectives give threads of one process different hosts.
  uint64_t host = 0;
};

// The host this process runs on: a hash of its kernel's boot id and its hostname, never 0.
// Processes with the same value share a kernel and, unless a container separates them (the
// testbed's hosts each have their own hostname and boot id), shared memory.
uint64_t this_host();

inline constexpr int kNoColor = -1;

struct SplitOptions {
  int color = 0;  // ranks with equal color form one sub-group; kNoColor: join none
  int key = 0;    // orders ranks in the sub-group (ties: by rank in this group)
  std::chrono::milliseconds timeout{0};  // 0: the group's default
};

struct SendOptions {
  const void* data = nullptr;  // borrowed until send() returns
  size_t bytes = 0;            // bytes, not elements
  int peer = 0;                // rank in this group
  uint32_t tag = 0;            // < 2^23
  std::chrono::milliseconds timeout{0};
};

struct RecvOptions {
  void* data = nullptr;
  size_t bytes = 0;  // the message must be exactly this long
  int peer = 0;
  uint32_t tag = 0;
  std::chrono::milliseconds timeout{0};
};

struct GroupLink;  // the worker and connections a world and its sub-groups share
namespace detail {
class ShmArena;    // per-group shared-memory scratch (detail/shm_arena.h)
class HostLayout;  // which ranks share a host (detail/host_layout.h)
}  // namespace detail

class Group {
 public:
  static Result<std::shared_ptr<Group>> connect(const ConnectOptions& options);
  ~Group();

  int rank() const { return rank_; }
  int size() const { return int(members_.size()); }
  uint32_t id() const { return id_; }
  int world_rank(int rank) const { return members_[size_t(rank)]; }
  std::chrono::milliseconds default_timeout() const;

  // Collective over this group. Returns nullptr (and OK) for a rank that passed kNoColor.
  Result<std::shared_ptr<Group>> split(const SplitOptions& options);

  Status send(const SendOptions& options);
  Status recv(const RecvOptions& options);
  // As send() and recv(), without waiting: the request completes once the message has gone
  // (arrived); wait() on it (with the deadline the options' timeout implies). The buffer is
  // borrowed until then. A pipeline posts its sends this way so that two neighbours sending to
  // each other at once cannot both block.
  Result<Request> start_send(const SendOptions& options);
  Result<Request> start_recv(const RecvOptions& options);
  // True when a message that `peer` sent with `tag` has arrived and no recv() has taken it:
  // that recv() then completes at once (Transport::probe; call worker().progress() first).
  bool probe(int peer, uint32_t user_tag);

  // ---- building blocks for the collectives in this folder -------------------------------
  // Every collective takes the next sequence number first, on every rank, even when it has
  // nothing to move, so that the numbers stay in step.
  uint32_t next_sequence() { return sequence_++; }
  Deadline deadline(std::chrono::milliseconds timeout) const;
  Request isend(int peer, uint32_t sequence, uint32_t step, const void* data, size_t bytes);
  Request irecv(int peer, uint32_t sequence, uint32_t step, void* data, size_t bytes);
  // Waits fail as soon as any member of the group is known to have failed.
  Status wait(Request& request, Deadline deadline);
  Status wait_all(std::span<Request> requests, Deadline deadline);
  Status wait_all(std::span<Request> requests, std::span<Request> others, Deadline deadline);
  // As wait_all, but only the failure of a rank in `must_live` (or of a request's own peer)
  // fails the wait: for steps after which some members may already have finished the
  // collective and left, as in the last rounds of a barrier.
  Status wait_all_watching(std::span<Request> requests, std::span<const int> must_live,
                           Deadline deadline);
  Transport& worker();
  // The worker's peer id for `rank` (!= this rank), for one-sided operations.
  int worker_peer(int rank) const { return peer_id(rank); }
  // Spins until `waiting_for()` returns -1, progressing the worker now and then. It returns
  // the group rank still being waited for otherwise, which the errors name. Fails as soon as
  // any member is known to have failed (kUnavailable) or at the deadline
  // (kDeadlineExceeded); `what()` says what was awaited ("allreduce: chunk 3 reduced"),
  // called only for an error.
  Status poll_until(const std::function<int()>& waiting_for, Deadline deadline,
                    const std::function<std::string()>& what);
  // The group's shared-memory scratch: null until a collective first needs it
  // (detail::shm_arena() creates it, collectively, and keeps it for the group's life).
  std::shared_ptr<detail::ShmArena>& shm_arena_slot() { return shm_; }
  // Which ranks share a host, and the sub-groups over them: null until a collective first
  // needs it (detail::host_layout() creates it, collectively).
  std::shared_ptr<detail::HostLayout>& host_layout_slot() { return hosts_; }
  // The host this rank counts as (ConnectOptions::host, or this_host()).
  uint64_t host() const;
  // "rank 2 of group 5 (world rank 7)" for error messages.
  std::string describe() const;

 private:
  Group() = default;
  void set_members(std::vector<int> world_ranks, int rank);
  // Collective over this group: a job-wide unique id, drawn by rank 0 and left under id_key.
  Result<uint32_t> draw_id(const std::string& id_key, std::chrono::milliseconds timeout);
  uint64_t tag(int sender, bool user, uint32_t low23) const;
  int peer_id(int rank) const;

  std::shared_ptr<GroupLink> link_;
  std::vector<int> members_;       // world ranks, in group rank order
  std::vector<int> member_peers_;  // worker peer ids of the other members
  int rank_ = 0;
  uint32_t id_ = 0;
  uint32_t sequence_ = 0;
  uint32_t splits_ = 0;  // split() calls so far, to name each split's key in the store
  // Declared last: its rkeys go before the worker that unpacked them.
  // Shared, not unique, so that this room needs no complete ShmArena (collectives/detail).
  std::shared_ptr<detail::ShmArena> shm_;
  std::shared_ptr<detail::HostLayout> hosts_;  // destroyed first: it holds sub-groups
};

}  // namespace wl::comm
