#include "weightlift/comm/collectives/detail/shm_arena.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "weightlift/comm/collectives/allgather.h"

namespace wl::comm::detail {

Result<std::unique_ptr<ShmArena>> ShmArena::create(Group& g, Deadline deadline) {
  const int P = g.size();
  auto arena = std::unique_ptr<ShmArena>(new ShmArena());
  arena->slot_bytes_ = (size_t(P) + 1) * kShmBlockBytes;
  const size_t flagged_offset = kHeaderBytes + kShmSlots * arena->slot_bytes_;
  const size_t bytes = flagged_offset + 2 * 2 * kShmFlaggedBytes;

  // A rank that cannot allocate still takes part in the exchange, with nothing to offer.
  auto region = g.worker().allocate_memory(bytes);
  if (region.ok()) {
    arena->own_ = std::move(*region);
    // Flag 0 is no call's: the flagged buffers start clear (before any peer maps them).
    std::memset(static_cast<std::byte*>(arena->own_.data()) + flagged_offset, 0,
                2 * 2 * kShmFlaggedBytes);
  }
  const std::vector<std::byte> empty;
  const std::vector<std::byte>& packed = region.ok() ? arena->own_.packed_rkey() : empty;

  // (address, rkey length) of every rank, then the rkeys themselves.
  std::vector<int64_t> mine = {int64_t(arena->own_.address()), int64_t(packed.size())};
  std::vector<int64_t> all(2 * size_t(P));
  // allgatherv, not allgather: allgather itself asks for the arena.
  const std::vector<size_t> twos(static_cast<size_t>(P), 2), ones(static_cast<size_t>(P), 1);
  WL_RETURN_IF_ERROR(allgatherv(g, {.send = mine.data(),
                                    .recv = all.data(),
                                    .counts = twos,
                                    .dtype = DType::kI64,
                                    .timeout = time_left(deadline)}));
  std::vector<size_t> lengths(static_cast<size_t>(P));
  for (int q = 0; q < P; ++q) lengths[size_t(q)] = size_t(all[2 * size_t(q) + 1]);
  std::vector<std::byte> keys(std::accumulate(lengths.begin(), lengths.end(), size_t(0)));
  WL_RETURN_IF_ERROR(allgatherv(g, {.send = packed.data(),
                                    .recv = keys.data(),
                                    .counts = lengths,
                                    .dtype = DType::kU8,
                                    .timeout = time_left(deadline)}));

  // Map every peer's region; any failure just means "not usable here".
  int64_t mapped = region.ok() && arena->map_peers(g, all, lengths, keys) ? 1 : 0;
  // Usable only if every rank mapped every region.
  std::vector<int64_t> verdicts(static_cast<size_t>(P));
  WL_RETURN_IF_ERROR(allgatherv(g, {.send = &mapped,
                                    .recv = verdicts.data(),
                                    .counts = ones,
                                    .dtype = DType::kI64,
                                    .timeout = time_left(deadline)}));
  arena->usable_ = std::all_of(verdicts.begin(), verdicts.end(), [](int64_t v) { return v == 1; });
  if (!arena->usable_) {
    arena->keys_.clear();
    arena->base_.clear();
    arena->own_ = MemoryRegion();
  } else {
    arena->staging.resize(kShmBlockBytes);
    arena->flagged_inputs.resize(size_t(P) * kShmFlaggedBytes);
  }
  return arena;
}

// Maps every peer's region from the exchanged (address, rkey length) pairs and rkeys;
// false at the first that cannot be mapped here.
bool ShmArena::map_peers(Group& g, const std::vector<int64_t>& addresses_and_lengths,
                         const std::vector<size_t>& lengths, const std::vector<std::byte>& keys) {
  const int P = g.size(), r = g.rank();
  keys_.resize(size_t(P));
  base_.assign(size_t(P), nullptr);
  base_[size_t(r)] = static_cast<std::byte*>(own_.data());
  size_t at = 0;
  for (int q = 0; q < P; at += lengths[size_t(q)], ++q) {
    const size_t len = lengths[size_t(q)];
    if (q == r) continue;
    if (len == 0) return false;
    auto key = g.worker().unpack_rkey(g.worker_peer(q), std::span(keys.data() + at, len));
    if (!key.ok()) return false;
    void* p = g.worker().remote_pointer(*key, uint64_t(addresses_and_lengths[2 * size_t(q)]));
    if (p == nullptr) return false;
    keys_[size_t(q)] = std::move(*key);
    base_[size_t(q)] = static_cast<std::byte*>(p);
  }
  return true;
}

Result<ShmArena*> shm_arena(Group& g, Deadline deadline) {
  std::shared_ptr<ShmArena>& slot = g.shm_arena_slot();
  if (slot == nullptr) {
    WL_ASSIGN_OR_RETURN(std::unique_ptr<ShmArena> made, ShmArena::create(g, deadline));
    slot = std::move(made);
  }
  return slot->usable() ? slot.get() : nullptr;
}

}  // namespace wl::comm::detail
