// MemoryStore: a Store in this process's memory, for ranks that run as threads (tests) and as
// the state behind the TCP store's server.
#pragma once

#include <map>

#include "weightlift/comm/store/store.h"
#include "weightlift/core/mutex.h"

namespace wl::comm {

class MemoryStore final : public Store {
 public:
  Status set(std::string_view key, std::span<const std::byte> value) override;
  Result<Bytes> get(std::string_view key, std::chrono::milliseconds timeout) override;
  Result<int64_t> add(std::string_view key, int64_t delta) override;

 private:
  Mutex mu_;
  CondVar changed_;
  std::map<std::string, Bytes, std::less<>> values_ WL_GUARDED_BY(mu_);
};

}  // namespace wl::comm
