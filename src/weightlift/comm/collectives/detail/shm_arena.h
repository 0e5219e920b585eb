// ShmArena: a group's persistent shared-memory scratch, through which the single-copy
// collectives (allreduce_shm.cc) move bytes with plain loads and stores.
//
// Each rank allocates one region through UCX (allocate_memory: a sysv or posix shared-memory
// segment), packs its rkey, and the group exchanges (address, rkey) once; every rank then maps
// every peer's region with remote_pointer() (ucp_rkey_ptr). After that no UCX call moves data:
// a rank writes into its own region and reads its peers' regions in place. The arena lives as
// long as the group, so no collective allocates, registers, or takes first-touch page faults.
//
// Layout of one rank's region (bytes):
//   [0, 256)                        three counters, one per 64-byte line (see Phase), written
//                                   only by the owner, read by every peer
//   slot s (s < kShmSlots), each (P+1) * block_bytes:
//     in[d]   d < P                 the owner's input for block d, copied there for rank d
//     res                           the owner's finished block, for every other rank to copy
//   flagged buffers f (f < 2), each 2 * kShmFlaggedBytes: a small allreduce's input, as 64-byte
//                                   lines of 56 data bytes and the call's number (allreduce_shm.cc)
// The counters only grow: counter[phase] = c means the owner has finished that phase for the
// group's chunks 0..c-1 (counted over the group's life). They are the only synchronisation;
// a peer that dies stops its counters, and the waits notice through UCX's keepalive
// (Group::poll_until).
//
// The arena exists only when every member could map every other's region (all ranks on one
// host with a shared-memory transport loaded); the members agree on that collectively, and
// otherwise usable() is false everywhere and the callers keep to tagged messages (TCP).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "weightlift/comm/collectives/reduce_op.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/comm/transport/transport.h"
#include "weightlift/core/dtype.h"

namespace wl::comm::detail {

// Slots in flight. A rank may run this many chunks ahead of its slowest peer before it has to
// wait for a slot to be read; the three-phase pipeline needs three.
inline constexpr size_t kShmSlots = 4;
// Bytes of one block of one chunk. A chunk (P blocks) and its copies stay in L2/L3 between
// the rank that writes them and the rank that reads them, so the shared scratch costs cache
// traffic, not DRAM traffic.
inline constexpr size_t kShmBlockBytes = 128 << 10;

enum class ShmPhase : int { kCopiedIn = 0, kReduced = 1, kCopiedOut = 2 };

// Allreduces of at most this many bytes carry their flag inside the data (allreduce_shm.cc):
// every cache line of the buffer holds 56 bytes of data and the call's number, so a peer
// learns that the data is there and reads it in the same cache miss.
// Up to 2 KiB (37 lines) it beats the one-shot path, once the lines are asked for all at
// once rather than as each store or load reaches them; at 4 KiB the one-shot path's single
// copy is as fast (docs/BENCHMARKS.md, "Measuring by turns").
inline constexpr size_t kShmFlaggedBytes = 2048;

// Whether a rank writes its slots with ordinary stores, which leave the data in cache for the
// peers, or streaming ones, which do not wait for a line a peer has read to come back first.
// Which costs less depends on whether the machine has put the cores on a shared cache at the
// moment (allreduce_shm.cc), so it is measured: each chunk's copy-in and reduction time per
// byte, averaged per mode. Ordinary stores are kept unless streaming is clearly cheaper (they
// also spare the peers a read from DRAM, which this rank's clock does not see), and one chunk
// in kExploreEvery tries the other mode so that a change of placement is noticed.
class SlotWriteChooser {
 public:
  static constexpr uint64_t kExploreEvery = 16;
  static constexpr double kMargin = 1.5;  // ordinary stores' cost / streaming's, to switch

  bool stream(uint64_t chunk) const {
    const bool preferred = cost_[1] > 0 && cost_[0] > kMargin * cost_[1];
    return chunk % kExploreEvery == kExploreEvery - 1 ? !preferred : preferred;
  }
  void record(bool streamed, double seconds_per_byte) {
    double& c = cost_[streamed ? 1 : 0];
    c = c == 0 ? seconds_per_byte : 0.8 * c + 0.2 * seconds_per_byte;
  }

 private:
  double cost_[2] = {0, 0};  // seconds per byte: ordinary, streaming
};

class ShmArena {
 public:
  // Collective over `group`: every member calls it in the same collective call. Fails only
  // when the exchange itself fails (a peer died, the deadline passed); an arena that cannot be
  // mapped is returned with usable() false.
  static Result<std::unique_ptr<ShmArena>> create(Group& group, Deadline deadline);

  bool usable() const { return usable_; }
  int ranks() const { return int(base_.size()); }
  size_t block_bytes() const { return kShmBlockBytes; }

  // Input block `dest` in slot `slot` of `rank`'s region, and that slot's result block.
  std::byte* in_block(int rank, size_t slot, int dest) const {
    return base_[size_t(rank)] + kHeaderBytes + slot * slot_bytes_ + size_t(dest) * kShmBlockBytes;
  }
  std::byte* res_block(int rank, size_t slot) const { return in_block(rank, slot, ranks()); }
  // Flagged buffer `which` (0 or 1) of `rank`'s region: 2 * kShmFlaggedBytes, line-aligned.
  std::byte* flagged_lines(int rank, uint64_t which) const {
    return base_[size_t(rank)] + kHeaderBytes + kShmSlots * slot_bytes_ +
           which * 2 * kShmFlaggedBytes;
  }

  // Owner side: release-stores the phase counter (the data written before becomes visible
  // to a peer that sees the new value).
  void publish(int self, ShmPhase phase, uint64_t chunks) const {
    std::atomic_ref<uint64_t>(*counter(self, phase)).store(chunks, std::memory_order_release);
  }
  uint64_t counter_of(int rank, ShmPhase phase) const {
    return std::atomic_ref<uint64_t>(*counter(rank, phase)).load(std::memory_order_acquire);
  }

  // Chunks the group has run through the arena so far; every member advances it alike.
  uint64_t chunks_done = 0;
  // The end of the last collective whose slots the peers read while copying out (allgather,
  // broadcast, a one-shot allreduce) rather than while reducing. A reducing collective that
  // reuses a slot of a chunk before this one waits for the peers' copy-out of it, not only
  // their reduction: they reduce such a chunk (a no-op) before they copy it out.
  uint64_t read_in_copy_out_until = 0;
  // How this rank writes its slots, measured as it goes (allreduce_shm.cc says why): by kind
  // (ShmKind), then [0] for outputs that stay in cache and [1] for 8 MiB and more, since
  // their costs per byte differ. And its private block (kShmBlockBytes) for the partial sums
  // of reductions over more than two ranks, allocated with the arena.
  SlotWriteChooser slot_writes[4][2];
  std::vector<std::byte> staging;
  // Flagged allreduces so far (every member alike), and where each one gathers the P inputs
  // before reducing them (P * kShmFlaggedBytes).
  uint64_t flagged_calls = 0;
  std::vector<std::byte> flagged_inputs;
  // Not OK once a collective on the arena failed: the counters may be out of step, so later
  // collectives fail at once instead of reading a peer's half-written slot.
  Status broken;

 private:
  static constexpr size_t kHeaderBytes = 256;
  bool map_peers(Group& g, const std::vector<int64_t>& addresses_and_lengths,
                 const std::vector<size_t>& lengths, const std::vector<std::byte>& keys);
  uint64_t* counter(int rank, ShmPhase phase) const {
    return reinterpret_cast<uint64_t*>(base_[size_t(rank)] + 64 * int(phase));
  }

  bool usable_ = false;
  size_t slot_bytes_ = 0;
  MemoryRegion own_;
  std::vector<RemoteKey> keys_;   // by group rank; empty for ourselves
  std::vector<std::byte*> base_;  // by group rank: our region or the mapping of a peer's
};

// The collectives the shared-memory pipeline runs (allreduce_shm.cc).
enum class ShmKind : uint8_t { kAllreduce, kReduceScatter, kAllgather, kBroadcast };
const char* shm_kind_name(ShmKind kind);

struct ShmCollectiveArgs {
  ShmKind kind = ShmKind::kAllreduce;
  // allreduce: count in, count out (may alias); reduce_scatter: P*count in, count out;
  // allgather: count in, P*count out (in may be the rank's block of out); broadcast: in ==
  // out, count elements, read on the root.
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;  // elements, > 0
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;  // kAvg divides by P at the end
  int root = 0;                  // broadcast only
  size_t segment_bytes = 0;      // block size override (tests); 0 or above kShmBlockBytes: that
};

Status shm_collective(Group& group, ShmArena& arena, const ShmCollectiveArgs& args,
                      Deadline deadline);

// The group's arena, created on first use (collectively: every member must reach this call in
// the same collective). Null when the group cannot use one; a failed exchange is an error.
Result<ShmArena*> shm_arena(Group& group, Deadline deadline);

}  // namespace wl::comm::detail
