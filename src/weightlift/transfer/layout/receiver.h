// Receiver: an inference process's weights in the inference layout, exposed for one-sided
// writes with one registration call, double-buffered so that readers never see a torn model.
//
// Why double buffering rather than pause/resume: the engine keeps generating from version v
// while version v+1 is written into the other buffer, and switching is one pointer flip; a
// pause/resume would stall generation for the whole write. The price is twice the weight
// memory, which an RL rollout engine can usually spare (and a pause-based receiver could be
// added as a mode later without changing the executor).
//
// Memory: both slots live in one allocation, [slot 0 | slot 1 | status], registered once. Each
// slot holds every tensor at a fixed offset (64-byte aligned, in the order given). Version v
// lives in slot v % 2; version 0 is the initial all-zero slot 0. The status block (64 bytes)
// holds two u64 words a peer may read with a one-sided get, without this process's help:
//     [0] the published version      [1] the version being written (0: none)
// which is all a restarted peer needs to copy a consistent version out of this receiver
// (fleet/heal_from_peer.h): version v's slot is rewritten only once [1] reaches v + 2.
//
// Readers (any thread) acquire() a ReadGuard pinning the active slot; the update (the rank's
// own thread, through the executor) waits for the other slot's readers to leave before it
// lets anyone write there, and publishes the new version only after every byte of it has
// arrived and been verified. So a guard sees exactly one version, for as long as it lives.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weightlift/comm/transport/transport.h"
#include "weightlift/core/mutex.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

struct ReceiverTensorSpec {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;
};

std::vector<ReceiverTensorSpec> tensor_specs(const std::vector<ReceiverTensor>& layout);

// Where a tensor sits in a slot.
struct ReceiverEntry {
  ReceiverTensorSpec spec;
  size_t offset = 0;  // bytes from the slot's start, 64-byte aligned
  size_t bytes = 0;
};

// The slot layout for `specs`: entries in order and the slot's size in bytes.
std::vector<ReceiverEntry> pack_receiver_tensors(const std::vector<ReceiverTensorSpec>& specs,
                                                 size_t* slot_bytes);

struct ReceiverOptions {
  std::vector<ReceiverTensorSpec> tensors;  // what this engine holds (inference_layout)
  int engine = 0;  // which inference engine (a group of tp x ep ranks) this rank belongs to
  int tp = 1;
  int tp_rank = 0;
  int ep = 1;  // expert parallelism (inference_layout.h): this rank holds one run of experts
  int ep_rank = 0;
  WeightFormat format = WeightFormat::kBF16;
  // Where both slots live. Empty: this process's memory (UCX's, so that a trainer on this host
  // can map it). Otherwise the name of a POSIX shared-memory object ("/weightlift-...", at most
  // 200 characters) created here, and removed when the receiver goes, that other processes of
  // this host may map read-only: an engine attached to a sidecar (fleet/sidecar.h).
  std::string shared_memory;
};

class Receiver {
 public:
  // Allocates and registers both slots with `worker`. Let the worker go first, or at least
  // never progress it once the receiver is gone: over TCP the bytes of a put whose sender gave
  // up on it (a failed update) may still wait in the worker's socket, and the worker copies
  // them into the slot whenever it next progresses, even while it closes. (The registration
  // keeps UCX's context alive by itself.)
  static Result<std::unique_ptr<Receiver>> create(comm::Transport& worker, ReceiverOptions options);
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  class ReadGuard {
   public:
    ReadGuard(ReadGuard&& other) noexcept;
    ReadGuard& operator=(ReadGuard&&) = delete;
    ~ReadGuard();
    uint64_t version() const { return version_; }
    int slot() const { return slot_; }  // which slot holds the version: version % 2, or 0 for 0
    // A borrowed view valid while the guard lives. REQUIRES: a name this receiver holds.
    Tensor tensor(std::string_view name) const;

   private:
    friend class Receiver;
    ReadGuard(const Receiver* r, int slot, uint64_t version)
        : receiver_(r), slot_(slot), version_(version) {}
    const Receiver* receiver_;
    int slot_;
    uint64_t version_;
  };
  ReadGuard acquire() const;

  uint64_t version() const;  // the last complete version (0: nothing received yet)
  // Changes every time a receiver is created; a plan made for another epoch is stale.
  uint64_t epoch() const { return epoch_; }
  const ReceiverOptions& options() const { return options_; }
  const std::vector<ReceiverEntry>& entries() const { return entries_; }
  const ReceiverEntry* find(std::string_view name) const;
  size_t slot_bytes() const { return slot_bytes_; }
  uint64_t slot_address(int slot) const;
  const std::vector<std::byte>& packed_rkey() const;
  const std::vector<std::byte>& worker_address() const { return worker_address_; }

  // ---- for the executor, from the rank's own thread -------------------------------------
  // Waits until no reader holds `slot`; then the slot may be written. `slot` must not be the
  // active one, except on a fresh receiver (version 0, nothing received), which then hands
  // its readers the other slot: both hold nothing. DeadlineExceeded if a reader holds on past
  // `deadline`.
  Status begin_write(int slot, comm::Deadline deadline);
  // Registers the same memory with another worker (the old one became unusable, transport.h):
  // a new rkey and worker address, the same epoch, slots and readers. REQUIRES: no update
  // running; `worker` as for create().
  Status attach(comm::Transport& worker);
  // Makes `version` (in `slot`) the one new readers get.
  void publish(int slot, uint64_t version);
  // The bytes of a slot (for verification, and for tests that corrupt or inspect it).
  std::span<std::byte> slot(int slot) const;

  // Where the status block of the top comment lives in the registered region.
  uint64_t status_address() const;
  // Its bytes here (for tests that check no one-sided write strays into it).
  std::span<std::byte> status_block() const;

  // ---- healing (fleet/heal_from_peer.h), before the receiver serves any reader ----------
  // A receiver that has just started fills the slot for `version` by itself (copying it from a
  // healthy peer or the servers' copy) and then adopts it. REQUIRES: version() == 0,
  // version > 0, no reader has acquired anything yet, and no update is running.
  std::span<std::byte> slot_for_healing(uint64_t version);
  void adopt(uint64_t version);

 private:
  Receiver() = default;
  void release(int slot) const WL_EXCLUDES(mu_);

  ReceiverOptions options_;
  std::vector<ReceiverEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  size_t slot_bytes_ = 0;
  // [slot 0 | slot 1 | status]. UCX allocates it (allocate_memory) so that on one host a
  // trainer can map the slots and store into them directly, one copy per byte, instead of
  // puts that UCX 1.13 moves through a bounce buffer when peer error handling is on
  // (modes/p2p.h); where UCX cannot, we allocate and register it ourselves (`malloced_`).
  std::byte* memory_ = nullptr;
  bool malloced_ = false;
  size_t mapped_bytes_ = 0;  // memory_ is a mapping of options_.shared_memory when not 0
  std::shared_ptr<comm::MemoryRegion> allocation_;  // owns memory_ unless malloced_
  std::shared_ptr<comm::MemoryRegion> region_;      // the current registration
  std::vector<std::byte> worker_address_;
  uint64_t epoch_ = 0;

  mutable Mutex mu_;
  mutable CondVar released_;
  int active_ WL_GUARDED_BY(mu_) = 0;
  uint64_t version_ WL_GUARDED_BY(mu_) = 0;
  mutable int readers_[2] WL_GUARDED_BY(mu_) = {0, 0};
  mutable bool read_ WL_GUARDED_BY(mu_) = false;  // some reader acquired a slot
  void set_status(uint64_t published, uint64_t writing) WL_REQUIRES(mu_);
};

}  // namespace wl::transfer
