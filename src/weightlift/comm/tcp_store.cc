// TCP store client and server. The server keeps its state in a MemoryStore, so a get that
// waits for a key parks the connection's thread on that store's condition variable.
#include "weightlift/comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "weightlift/comm/detail/store_wire.h"

namespace wl::comm {

namespace {

using detail::StoreOp;
using detail::StoreRequest;
using detail::StoreResponse;

// A get may ask the server to wait at most this long; longer waits are the client's to split.
constexpr uint32_t kMaxWaitMs = 24u * 3600u * 1000u;
// Slack on top of a get's wait for the reply to travel back.
constexpr auto kReplySlack = std::chrono::seconds(5);

// Constant-time comparison, so the time a refusal takes says nothing about the token.
bool same_token(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

// ---- server -------------------------------------------------------------------------------

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(const TcpStoreServerOptions& o) {
  std::unique_ptr<TcpStoreServer> s(new TcpStoreServer());
  s->token_ = o.token;
  const std::string where =
      "rendezvous store server on " + o.bind_address + ":" + std::to_string(o.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(o.bind_address.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return invalid_argument(where + ": " + gai_strerror(rc));
  }
  Status last = unavailable(where + ": no usable address");
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = errno_status(where + ": socket", errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      last = errno_status(where + ": bind/listen", errno);
      ::close(fd);
      continue;
    }
    s->listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(res);
  if (s->listen_fd_ < 0) return last;
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->acceptor_ = std::thread([srv = s.get()] { srv->accept_loop(); });
  return s;
}

TcpStoreServer::~TcpStoreServer() {
  stopping_ = true;
  state_.shut_down();  // wakes connection threads parked in a waiting get
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<std::thread> threads;  // no new ones: the acceptor has stopped
  {
    MutexLock lock(mu_);
    for (int fd : connection_fds_) ::shutdown(fd, SHUT_RDWR);
    threads.swap(connections_);
  }
  for (auto& t : threads) t.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void TcpStoreServer::accept_loop() {
  while (!stopping_) {
    // Poll with a short timeout so that stopping is noticed without closing the socket
    // under a blocked accept.
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 50) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_nodelay(fd);
    MutexLock lock(mu_);
    connection_fds_.push_back(fd);
    connections_.emplace_back([this, fd] { serve(fd); });
  }
}

void TcpStoreServer::serve(int fd) {
  const std::string what = "rendezvous store client";
  while (!stopping_) {
    // Wait for the next request in slices, so a stopping server is noticed between requests.
    pollfd pfd{fd, POLLIN, 0};
    int n = ::poll(&pfd, 1, 100);
    if (n == 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    uint8_t format_version = detail::kStoreWireFormatVersion;
    auto request =
        detail::read_request(fd, deadline_after(std::chrono::seconds(30)), what, &format_version);
    StoreResponse response;
    bool close_after = false;
    if (!request.ok()) {
      if (request.status().code() == StatusCode::kUnavailable) break;  // client hung up
      response.code = request.status().code();
      response.payload = to_bytes(request.status().message());
      close_after = true;  // the stream is out of step after a malformed request
    } else if (!same_token(request->token, token_)) {
      response.code = StatusCode::kPermissionDenied;
      response.payload = to_bytes(
          "wrong job token: this process does not belong to the job "
          "(check WEIGHTLIFT_JOB_TOKEN)");
      close_after = true;
    } else {
      Status s;
      switch (request->op) {
        case StoreOp::kSet:
          s = state_.set(request->key, request->value);
          break;
        case StoreOp::kGet: {
          auto v = state_.get(request->key, std::chrono::milliseconds(request->timeout_ms));
          if (v.ok()) response.payload = std::move(*v);
          s = v.status();
          break;
        }
        case StoreOp::kAdd: {
          int64_t delta = 0;
          if (request->value.size() != 8) {
            s = invalid_argument("add needs an 8-byte delta");
            break;
          }
          std::memcpy(&delta, request->value.data(), 8);
          auto v = state_.add(request->key, delta);
          if (v.ok()) {
            response.payload.resize(8);
            std::memcpy(response.payload.data(), &*v, 8);
          }
          s = v.status();
          break;
        }
      }
      if (!s.ok()) {
        response.code = s.code();
        response.payload = to_bytes(s.message());
      }
    }
    Bytes frame = detail::encode_response(response);
    Status w = detail::write_all(fd, frame.data(), frame.size(),
                                 deadline_after(std::chrono::seconds(30)), what);
    if (!w.ok() || close_after) break;
  }
  {
    MutexLock lock(mu_);
    std::erase(connection_fds_, fd);
  }
  ::close(fd);
}

// ---- client -------------------------------------------------------------------------------

// One TCP connection to any of `addresses`, tried again with backoff (the server may start
// after its clients) until `timeout`.
Result<int> connect_with_retries(addrinfo* addresses, const std::string& where,
                                 std::chrono::milliseconds timeout) {
  const Deadline deadline = deadline_after(timeout);
  Status last = unavailable(where + ": no address");
  int delay_ms = 5;
  for (;;) {
    for (addrinfo* ai = addresses; ai != nullptr; ai = ai->ai_next) {
      int fd =
          ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (fd < 0) {
        last = errno_status(where + ": socket", errno);
        continue;
      }
      int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        // Wait for the handshake, bounded by what is left of the deadline.
        pollfd pfd{fd, POLLOUT, 0};
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        rc = ::poll(&pfd, 1, int(std::max<int64_t>(left.count(), 0)));
        int err = 0;
        socklen_t len = sizeof err;
        if (rc == 1) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        errno = rc == 1 ? err : ETIMEDOUT;
        rc = (rc == 1 && err == 0) ? 0 : -1;
      }
      if (rc == 0) {
        set_nodelay(fd);
        return fd;
      }
      last = errno_status(where + ": connect", errno);
      ::close(fd);
    }
    if (Clock::now() + std::chrono::milliseconds(delay_ms) >= deadline) {
      return deadline_exceeded(where + ": could not connect within " +
                               std::to_string(timeout.count()) +
                               " ms (last error: " + last.to_string() + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));  // backoff, not ordering
    delay_ms = std::min(delay_ms * 2, 200);
  }
}

Result<std::unique_ptr<TcpStore>> TcpStore::connect(const TcpStoreOptions& o) {
  std::unique_ptr<TcpStore> c(new TcpStore());
  c->options_ = o;
  c->where_ = "rendezvous store at " + o.host + ":" + std::to_string(o.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(o.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return invalid_argument(c->where_ + ": " + gai_strerror(rc));
  }
  const Result<int> fd = connect_with_retries(res, c->where_, o.connect_timeout);
  ::freeaddrinfo(res);
  if (!fd.ok()) return fd.status();
  MutexLock lock(c->mu_);
  c->fd_ = *fd;
  return c;
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

Result<Bytes> TcpStore::call(uint8_t op, std::string_view key, Bytes value,
                             std::chrono::milliseconds wait) {
  if (key.size() > detail::kStoreMaxKeyBytes) {
    return invalid_argument(where_ + ": key of " + std::to_string(key.size()) + " bytes");
  }
  if (value.size() > detail::kStoreMaxValueBytes) {
    return invalid_argument(where_ + ": value of " + std::to_string(value.size()) + " bytes");
  }
  StoreRequest r;
  r.op = StoreOp(op);
  r.token = options_.token;
  r.key = std::string(key);
  r.value = std::move(value);
  r.timeout_ms = uint32_t(std::clamp<int64_t>(wait.count(), 0, kMaxWaitMs));
  Bytes frame = detail::encode_request(r);
  MutexLock lock(mu_);
  if (fd_ < 0) return unavailable(where_ + ": connection closed after an earlier error");
  const Deadline deadline = deadline_after(options_.request_timeout) + wait + kReplySlack;
  Status s = detail::write_all(fd_, frame.data(), frame.size(), deadline, where_);
  auto response = s.ok() ? detail::read_response(fd_, deadline, where_) : Result<StoreResponse>(s);
  if (!response.ok()) {
    // The stream may be out of step; no later request may read this one's reply.
    ::close(fd_);
    fd_ = -1;
    return response.status();
  }
  if (response->code != StatusCode::kOk) {
    if (response->code == StatusCode::kPermissionDenied) {
      ::close(fd_);
      fd_ = -1;
    }
    return Status(response->code,
                  where_ + " refused '" + std::string(key) + "': " + to_string(response->payload));
  }
  return std::move(response->payload);
}

Status TcpStore::set(std::string_view key, std::span<const std::byte> value) {
  return call(uint8_t(StoreOp::kSet), key, Bytes(value.begin(), value.end()),
              std::chrono::milliseconds(0))
      .status();
}

Result<Bytes> TcpStore::get(std::string_view key, std::chrono::milliseconds timeout) {
  return call(uint8_t(StoreOp::kGet), key, {}, timeout);
}

Result<int64_t> TcpStore::add(std::string_view key, int64_t delta) {
  Bytes d(8);
  std::memcpy(d.data(), &delta, 8);
  WL_ASSIGN_OR_RETURN(
      Bytes v, call(uint8_t(StoreOp::kAdd), key, std::move(d), std::chrono::milliseconds(0)));
  if (v.size() != 8)
    return data_loss(where_ + ": add replied with " + std::to_string(v.size()) + " bytes");
  int64_t now = 0;
  std::memcpy(&now, v.data(), 8);
  return now;
}

}  // namespace wl::comm
