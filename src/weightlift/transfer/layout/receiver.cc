// Receiver: slot layout, registration, and the reader/writer handshake of layout/receiver.h.
#include "weightlift/transfer/layout/receiver.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "weightlift/core/mapping_lock.h"

namespace wl::transfer {
namespace {
constexpr size_t kAlign = 64;
constexpr size_t kStatusBytes = 64;

uint64_t new_epoch() {
  // Unique per creation within a process (the counter) and across restarts (the random bits).
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t r = (uint64_t(rd()) << 32) ^ rd();
  return (r << 16) ^ (counter.fetch_add(1) + 1);
}

// Creates the shared-memory object `name` of `bytes` (zero-filled, every page reserved now so
// that a full /dev/shm is this error rather than a SIGBUS at the first write) and maps it.
Result<std::byte*> map_new_shared_memory(const std::string& name, size_t bytes) {
  const std::string what = "receiver: shared memory '" + name + "'";
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 200) {
    return invalid_argument(what + ": expected '/' then up to 199 characters without '/'");
  }
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    if (errno == EEXIST) {
      return failed_precondition(what +
                                 " already exists: another receiver's, or left by one that "
                                 "was killed (remove /dev/shm" +
                                 name + " if none runs)");
    }
    return errno_status(what + ": shm_open", errno);
  }
  Status failed = ok_status();
  if (const int e = ::posix_fallocate(fd, 0, off_t(bytes)); e != 0) {
    failed = errno_status(what + ": reserving " + std::to_string(bytes) + " bytes", e);
  }
  void* p = MAP_FAILED;
  if (failed.ok()) {
    p = mmap_in_order(bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd);
    if (p == MAP_FAILED) failed = errno_status(what + ": mmap", errno);
  }
  ::close(fd);
  if (!failed.ok()) {
    ::shm_unlink(name.c_str());
    return failed;
  }
  return static_cast<std::byte*>(p);
}
}  // namespace

std::vector<ReceiverTensorSpec> tensor_specs(const std::vector<ReceiverTensor>& layout) {
  std::vector<ReceiverTensorSpec> out;
  for (const ReceiverTensor& t : layout) out.push_back({t.name, t.dtype, t.shape});
  return out;
}

std::vector<ReceiverEntry> pack_receiver_tensors(const std::vector<ReceiverTensorSpec>& specs,
                                                 size_t* slot_bytes) {
  std::vector<ReceiverEntry> out;
  size_t at = 0;
  for (const ReceiverTensorSpec& s : specs) {
    const size_t bytes = size_t(shape_numel(s.shape)) * dtype_size(s.dtype);
    out.push_back({s, at, bytes});
    at += (bytes + kAlign - 1) / kAlign * kAlign;
  }
  *slot_bytes = std::max(at, kAlign);
  return out;
}

Result<std::unique_ptr<Receiver>> Receiver::create(comm::Transport& worker,
                                                   ReceiverOptions options) {
  std::unique_ptr<Receiver> r(new Receiver());
  r->options_ = std::move(options);
  r->entries_ = pack_receiver_tensors(r->options_.tensors, &r->slot_bytes_);
  for (size_t i = 0; i < r->entries_.size(); ++i) {
    if (!r->index_.emplace(r->entries_[i].spec.name, i).second) {
      return invalid_argument("receiver: tensor '" + r->entries_[i].spec.name + "' listed twice");
    }
  }
  const size_t total = 2 * r->slot_bytes_ + kStatusBytes;
  if (!r->options_.shared_memory.empty()) {
    WL_ASSIGN_OR_RETURN(r->memory_, map_new_shared_memory(r->options_.shared_memory, total));
    r->mapped_bytes_ = total;
    WL_ASSIGN_OR_RETURN(comm::MemoryRegion region, worker.register_memory(r->memory_, total));
    r->region_ = std::make_shared<comm::MemoryRegion>(std::move(region));
  } else if (auto shared = worker.allocate_memory(total); shared.ok()) {
    r->allocation_ = std::make_shared<comm::MemoryRegion>(std::move(*shared));
    r->region_ = r->allocation_;
    r->memory_ = static_cast<std::byte*>(r->allocation_->data());  // zero-filled
  } else {
    r->memory_ = static_cast<std::byte*>(std::aligned_alloc(kAlign, total));
    if (r->memory_ == nullptr) {
      return resource_exhausted("receiver: allocating " + std::to_string(total) +
                                " bytes of weight slots");
    }
    r->malloced_ = true;
    std::memset(r->memory_, 0, total);
    WL_ASSIGN_OR_RETURN(comm::MemoryRegion region, worker.register_memory(r->memory_, total));
    r->region_ = std::make_shared<comm::MemoryRegion>(std::move(region));
  }
  r->worker_address_ = worker.address();
  r->epoch_ = new_epoch();
  return r;
}

Receiver::~Receiver() {
  region_.reset();  // unregister before the memory goes
  allocation_.reset();
  if (malloced_) std::free(memory_);
  if (mapped_bytes_ != 0) {
    munmap_in_order(memory_, mapped_bytes_);
    ::shm_unlink(options_.shared_memory.c_str());
  }
}

const ReceiverEntry* Receiver::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &entries_[it->second];
}

uint64_t Receiver::slot_address(int slot) const {
  WL_CHECK(slot == 0 || slot == 1) << slot;
  return region_->address() + uint64_t(slot) * slot_bytes_;
}

const std::vector<std::byte>& Receiver::packed_rkey() const { return region_->packed_rkey(); }

std::span<std::byte> Receiver::slot(int slot) const {
  WL_CHECK(slot == 0 || slot == 1) << slot;
  return {memory_ + size_t(slot) * slot_bytes_, slot_bytes_};
}

Status Receiver::attach(comm::Transport& worker) {
  WL_ASSIGN_OR_RETURN(comm::MemoryRegion region,
                      worker.register_memory(memory_, 2 * slot_bytes_ + kStatusBytes));
  region_ = std::make_shared<comm::MemoryRegion>(std::move(region));  // allocation_ stays
  worker_address_ = worker.address();
  return ok_status();
}

uint64_t Receiver::status_address() const { return region_->address() + 2 * slot_bytes_; }

std::span<std::byte> Receiver::status_block() const {
  return {memory_ + 2 * slot_bytes_, kStatusBytes};
}

void Receiver::set_status(uint64_t published, uint64_t writing) {
  // Peers read these words with one-sided gets at any time: each is stored whole.
  auto* words = reinterpret_cast<uint64_t*>(memory_ + 2 * slot_bytes_);
  std::atomic_ref<uint64_t>(words[1]).store(writing, std::memory_order_release);
  std::atomic_ref<uint64_t>(words[0]).store(published, std::memory_order_release);
}

std::span<std::byte> Receiver::slot_for_healing(uint64_t version) {
  MutexLock lock(mu_);
  WL_CHECK_EQ(version_, 0u) << "healing a receiver that already holds a version";
  WL_CHECK(!read_) << "healing a receiver that readers already use";
  WL_CHECK_GT(version, 0u);
  return slot(int(version % 2));
}

void Receiver::adopt(uint64_t version) {
  MutexLock lock(mu_);
  WL_CHECK_EQ(version_, 0u) << "adopting into a receiver that already holds a version";
  WL_CHECK(!read_) << "adopting into a receiver that readers already use";
  active_ = int(version % 2);
  version_ = version;
  set_status(version_, 0);
}

Receiver::ReadGuard Receiver::acquire() const {
  MutexLock lock(mu_);
  read_ = true;
  ++readers_[active_];
  return ReadGuard(this, active_, version_);
}

void Receiver::release(int slot) const {
  {
    MutexLock lock(mu_);
    --readers_[slot];
  }
  released_.notify_all();
}

uint64_t Receiver::version() const {
  MutexLock lock(mu_);
  return version_;
}

Status Receiver::begin_write(int slot, comm::Deadline deadline) {
  MutexLock lock(mu_);
  if (slot == active_) {
    WL_CHECK_EQ(version_, 0u) << "writing the slot readers use";
    active_ = 1 - slot;  // version 0 is nothing in either slot
  }
  if (!released_.wait_until(lock, deadline,
                            [&]() WL_NO_THREAD_SAFETY_ANALYSIS { return readers_[slot] == 0; })) {
    return deadline_exceeded("receiver: " + std::to_string(readers_[slot]) +
                             " reader(s) still hold version " +
                             std::to_string(version_ == 0 ? 0 : version_ - 1) +
                             "'s weights; cannot write the next version into them");
  }
  set_status(version_, version_ + 1);
  return ok_status();
}

void Receiver::publish(int slot, uint64_t version) {
  MutexLock lock(mu_);
  WL_CHECK_EQ(readers_[slot], 0);
  active_ = slot;
  version_ = version;
  set_status(version_, 0);
}

Receiver::ReadGuard::ReadGuard(ReadGuard&& o) noexcept
    : receiver_(o.receiver_), slot_(o.slot_), version_(o.version_) {
  o.receiver_ = nullptr;
}

Receiver::ReadGuard::~ReadGuard() {
  if (receiver_ != nullptr) receiver_->release(slot_);
}

Tensor Receiver::ReadGuard::tensor(std::string_view name) const {
  const ReceiverEntry* e = receiver_->find(name);
  WL_CHECK(e != nullptr) << "receiver holds no tensor '" << name << "'";
  return Tensor::borrow(receiver_->slot(slot_).data() + e->offset, e->spec.dtype, e->spec.shape);
}

}  // namespace wl::transfer
