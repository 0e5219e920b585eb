#include "weightlift/comm/memory_store.h"

#include <cstring>

namespace wl::comm {

namespace {
Status store_gone() { return unavailable("rendezvous store is shutting down"); }
}  // namespace

Status MemoryStore::set(std::string_view key, std::span<const std::byte> value) {
  {
    MutexLock lock(mu_);
    if (shut_down_) return store_gone();
    values_[std::string(key)] = Bytes(value.begin(), value.end());
  }
  changed_.notify_all();
  return ok_status();
}

Result<Bytes> MemoryStore::get(std::string_view key, std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // The analysis cannot see that the predicate runs with mu_ held (CondVar::wait_until does).
  auto ready = [&]() WL_NO_THREAD_SAFETY_ANALYSIS {
    return shut_down_ || values_.find(key) != values_.end();
  };
  changed_.wait_until(lock, deadline, ready);
  if (shut_down_) return store_gone();
  if (auto it = values_.find(key); it != values_.end()) return it->second;
  return deadline_exceeded("rendezvous key '" + std::string(key) + "' was not set within " +
                           std::to_string(timeout.count()) + " ms");
}

Result<int64_t> MemoryStore::add(std::string_view key, int64_t delta) {
  int64_t now = 0;
  {
    MutexLock lock(mu_);
    if (shut_down_) return store_gone();
    Bytes& v = values_[std::string(key)];
    if (!v.empty() && v.size() != 8) {
      return invalid_argument("rendezvous key '" + std::string(key) +
                              "' holds a value that is not a counter");
    }
    if (v.size() == 8) std::memcpy(&now, v.data(), 8);
    now += delta;
    v.resize(8);
    std::memcpy(v.data(), &now, 8);
  }
  changed_.notify_all();
  return now;
}

void MemoryStore::shut_down() {
  {
    MutexLock lock(mu_);
    shut_down_ = true;
  }
  changed_.notify_all();
}

}  // namespace wl::comm
