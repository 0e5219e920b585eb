#include "weightlift/comm/store/memory_store.h"

#include <cstring>

namespace wl::comm {

Status MemoryStore::set(std::string_view key, std::span<const std::byte> value) {
  {
    MutexLock lock(mu_);
    values_[std::string(key)] = Bytes(value.begin(), value.end());
  }
  changed_.notify_all();
  return ok_status();
}

Result<Bytes> MemoryStore::get(std::string_view key, std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // The analysis cannot see that the predicate runs with mu_ held (CondVar::wait_until does).
  auto ready = [&]() WL_NO_THREAD_SAFETY_ANALYSIS { return values_.find(key) != values_.end(); };
  changed_.wait_until(lock, deadline, ready);
  if (auto it = values_.find(key); it != values_.end()) return it->second;
  return deadline_exceeded("rendezvous key '" + std::string(key) + "' was not set within " +
                           std::to_string(timeout.count()) + " ms");
}

Result<int64_t> MemoryStore::add(std::string_view key, int64_t delta) {
  int64_t now = 0;
  {
    MutexLock lock(mu_);
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

}  // namespace wl::comm
