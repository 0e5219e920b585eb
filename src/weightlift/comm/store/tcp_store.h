// The rendezvous store over TCP: a server that one process (rank 0) runs on
// MASTER_ADDR:MASTER_PORT, and a client every process uses.
//
// Plain sockets and the wire format of detail/store_wire.h (versioned; docs/formats.md). The
// server binds 127.0.0.1 unless told otherwise, so a single-host job is invisible from the
// network, and it refuses every request that does not carry the job's token
// (kPermissionDenied). Every client call has a deadline. A client whose connection failed (a
// request that timed out or broke: a link cut, say) fails that request and connects again for
// the next one, so a process cut off from the store for a while carries on once it is back.
//
// The server is built to survive a hostile peer on its port (tcp_store_server.cc): one thread
// runs an event loop over every connection, whatever their number; nothing a peer declares is
// allocated before it has presented the job's token; a connection must present it within the
// handshake timeout and finish each request, and take each reply, within the request timeout;
// connections are bounded, and when full the oldest one that never presented the token is
// closed for the newcomer.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "weightlift/comm/store/store.h"
#include "weightlift/core/mutex.h"

namespace wl::comm {

struct TcpStoreServerOptions {
  // Address to listen on. Loopback keeps a one-host job private; a multi-host job passes the
  // interface the other hosts reach (or "0.0.0.0").
  std::string bind_address = "127.0.0.1";
  int port = 0;       // 0: any free port (see port())
  std::string token;  // the job token requests must carry
  // Connections open at once; 0: 4096, or fewer if RLIMIT_NOFILE leaves fewer descriptors.
  int max_connections = 0;
  // A new connection must deliver its first request's header and token within this.
  std::chrono::milliseconds handshake_timeout{10000};
  // A request, once begun, must arrive whole within this; a reply must be taken within this.
  std::chrono::milliseconds request_timeout{30000};
  // Bytes of keys and values the store keeps in all; a set beyond it is kResourceExhausted.
  uint64_t max_stored_bytes = uint64_t(1) << 30;
};

class TcpStoreServer {
 public:
  static Result<std::unique_ptr<TcpStoreServer>> start(const TcpStoreServerOptions& options);
  ~TcpStoreServer();  // stops serving; waiting clients see their connection close
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;
  size_t connections() const;  // open now
  size_t waiting() const;      // gets waiting for their key now

  struct Loop;  // tcp_store_server.cc

 private:
  TcpStoreServer() = default;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

// One address of a server, as getaddrinfo gave it.
struct SocketAddress {
  int family = 0, protocol = 0;
  socklen_t length = 0;
  sockaddr_storage address{};
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;
  // How long to keep trying to connect; the server may start after its clients.
  std::chrono::milliseconds connect_timeout{30000};
  // Deadline for a set or add; a get waits its own timeout plus this. A long get leaves the
  // connection to the process's other threads every 50 ms.
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
  // `not_set`: told whether the server answered that the key was not set within `wait`
  // (rather than the connection failing or timing out).
  Result<Bytes> call(uint8_t op, std::string_view key, Bytes value, std::chrono::milliseconds wait,
                     bool* not_set = nullptr);

  // A new connection in place of one that failed, made without holding a request for long
  // (tcp_store.cc: kHandshakeWait); Unavailable until it is there, and for good once it finds
  // a server other than the one this client joined.
  Status reconnect() WL_REQUIRES(mu_);
  // The server's incarnation key (detail::kStoreIncarnationKey) through fd_: its value, or
  // empty when it has none. A failed exchange closes fd_.
  Result<Bytes> read_incarnation() WL_REQUIRES(mu_);

  TcpStoreOptions options_;
  std::string where_;                     // "rendezvous store at 127.0.0.1:29500"
  std::vector<SocketAddress> addresses_;  // the server's, resolved once
  Mutex mu_;                              // one request at a time on the connection
  int fd_ WL_GUARDED_BY(mu_) = -1;
  bool refused_ WL_GUARDED_BY(mu_) = false;    // the server refused our token: never again
  bool restarted_ WL_GUARDED_BY(mu_) = false;  // the server is not the one we joined: never
  Bytes incarnation_ WL_GUARDED_BY(mu_);       // the joined server's, read at connect()
  int handshake_fd_ WL_GUARDED_BY(mu_) = -1;   // a connection being made again
  std::chrono::steady_clock::time_point handshake_until_ WL_GUARDED_BY(mu_);
  size_t next_address_ WL_GUARDED_BY(mu_) = 0;  // the one the next handshake goes to
  std::atomic<int> queued_{0};                  // requests waiting for mu_
};

}  // namespace wl::comm
