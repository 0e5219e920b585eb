// The rendezvous store over TCP: a server that one process (rank 0) runs on
// MASTER_ADDR:MASTER_PORT, and a client every process uses.
//
// Plain sockets, one thread per client connection on the server, the wire format of
// detail/store_wire.h (versioned; docs/formats.md). The server binds 127.0.0.1 unless told
// otherwise, so a single-host job is invisible from the network, and it refuses every request
// that does not carry the job's token (kPermissionDenied). Every client call has a deadline.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "weightlift/comm/memory_store.h"
#include "weightlift/comm/store.h"
#include "weightlift/core/mutex.h"

namespace wl::comm {

struct TcpStoreServerOptions {
  // Address to listen on. Loopback keeps a one-host job private; a multi-host job passes the
  // interface the other hosts reach (or "0.0.0.0").
  std::string bind_address = "127.0.0.1";
  int port = 0;       // 0: any free port (see port())
  std::string token;  // the job token requests must carry
};

class TcpStoreServer {
 public:
  static Result<std::unique_ptr<TcpStoreServer>> start(const TcpStoreServerOptions& options);
  ~TcpStoreServer();  // stops serving; waiting clients get an error
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }

 private:
  TcpStoreServer() = default;
  void accept_loop();
  void serve(int fd);

  std::string token_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  MemoryStore state_;
  std::thread acceptor_;
  Mutex mu_;
  std::vector<std::thread> connections_ WL_GUARDED_BY(mu_);
  std::vector<int> connection_fds_ WL_GUARDED_BY(mu_);
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;
  // How long to keep trying to connect; the server may start after its clients.
  std::chrono::milliseconds connect_timeout{30000};
  // Deadline for a set or add; a get waits its own timeout plus this.
  std::chrono::milliseconds request_timeout{30000};
};

class TcpStore final : public Store {
 public:
  static Result<std::unique_ptr<TcpStore>> connect(const TcpStoreOptions& options);
  ~TcpStore() override;

  Status set(std::string_view key, std::span<const std::byte> value) override;
  Result<Bytes> get(std::string_view key, std::chrono::milliseconds timeout) override;
  Result<int64_t> add(std::string_view key, int64_t delta) override;

 private:
  TcpStore() = default;
  Result<Bytes> call(uint8_t op, std::string_view key, Bytes value, std::chrono::milliseconds wait);

  TcpStoreOptions options_;
  std::string where_;  // "rendezvous store at 127.0.0.1:29500"
  Mutex mu_;           // one request at a time on the connection
  int fd_ WL_GUARDED_BY(mu_) = -1;
};

}  // namespace wl::comm
