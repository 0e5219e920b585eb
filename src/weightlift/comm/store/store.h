// Store: the key-value blackboard processes use to find each other.
//
// Rendezvous needs little: rank r publishes its UCX worker address under a key, everyone else
// waits for that key; a counter hands out unique ids. Two implementations: MemoryStore
// (memory_store.h) for ranks that are threads of one process, and the TCP store
// (tcp_store.h) that a job's processes reach at MASTER_ADDR:MASTER_PORT. As in gloo, the
// store is only for exchanging addresses; no tensor data goes through it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::comm {

using Bytes = std::vector<std::byte>;

inline Bytes to_bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return Bytes(p, p + s.size());
}
inline std::string to_string(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

// Implementations are safe to call from several threads at once.
class Store {
 public:
  virtual ~Store() = default;

  // Sets (or replaces) `key`.
  virtual Status set(std::string_view key, std::span<const std::byte> value) = 0;
  // The value of `key`, waiting up to `timeout` for someone to set it; kDeadlineExceeded
  // naming the key if no one does.
  virtual Result<Bytes> get(std::string_view key, std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the integer counter `key` (absent counts as 0); returns the new value.
  virtual Result<int64_t> add(std::string_view key, int64_t delta) = 0;
};

}  // namespace wl::comm
