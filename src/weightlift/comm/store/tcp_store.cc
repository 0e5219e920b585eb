// The TCP store's client: one connection, one request at a time, every call under a deadline.
// The server is tcp_store_server.cc.
#include "weightlift/comm/store/tcp_store.h"

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
#include <span>
#include <thread>
#include <utility>

#include "weightlift/comm/store/detail/store_wire.h"

namespace wl::comm {

namespace {

using detail::StoreOp;
using detail::StoreRequest;
using detail::StoreResponse;

// Slack on top of a get's wait for the reply to travel back.
constexpr auto kReplySlack = std::chrono::seconds(5);
// A get's longest single wait at the server (TcpStore::get).
constexpr auto kGetSlice = std::chrono::milliseconds(50);
// The longest get: a year, so that adding it to the clock cannot overflow.
constexpr int64_t kMaxGetMs = int64_t(365) * 24 * 3600 * 1000;

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

// ---- client -------------------------------------------------------------------------------

// One TCP connection to any of `addresses`, tried again with backoff (the server may start
// after its clients) until `timeout`.
Result<int> connect_with_retries(std::span<const SocketAddress> addresses, const std::string& where,
                                 std::chrono::milliseconds timeout) {
  const Deadline deadline = deadline_after(timeout);
  Status last = unavailable(where + ": no address");
  int delay_ms = 5;
  for (;;) {
    for (const SocketAddress& a : addresses) {
      int fd = ::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, a.protocol);
      if (fd < 0) {
        last = errno_status(where + ": socket", errno);
        continue;
      }
      int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&a.address), a.length);
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

namespace {

// The addresses `o` names, resolved once (a name server that cannot be reached later, when
// the connection has to be made again, costs nothing then).
Result<std::vector<SocketAddress>> resolve(const TcpStoreOptions& o, const std::string& where) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(o.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return invalid_argument(where + ": " + gai_strerror(rc));
  }
  std::vector<SocketAddress> addresses;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SocketAddress a{.family = ai->ai_family, .protocol = ai->ai_protocol, .length = ai->ai_addrlen};
    std::memcpy(&a.address, ai->ai_addr, ai->ai_addrlen);
    addresses.push_back(a);
  }
  ::freeaddrinfo(res);
  if (addresses.empty()) return invalid_argument(where + ": no address");
  return addresses;
}

// Connecting again after the connection failed never holds a request for long: the call that
// starts a handshake waits kHandshakeWait for it (a reachable server answers well within it),
// later calls look at it without waiting, and a handshake not done within kReconnectTimeout
// is dropped for a new one to the next address. Until one completes each request fails at
// once, as it did with the connection gone, so a loop that polls the store stays a loop.
constexpr std::chrono::milliseconds kHandshakeWait{20};
constexpr std::chrono::milliseconds kReconnectTimeout{2000};

}  // namespace

Result<std::unique_ptr<TcpStore>> TcpStore::connect(const TcpStoreOptions& o) {
  std::unique_ptr<TcpStore> c(new TcpStore());
  c->options_ = o;
  c->where_ = "rendezvous store at " + o.host + ":" + std::to_string(o.port);
  WL_ASSIGN_OR_RETURN(c->addresses_, resolve(o, c->where_));
  WL_ASSIGN_OR_RETURN(const int fd,
                      connect_with_retries(c->addresses_, c->where_, o.connect_timeout));
  MutexLock lock(c->mu_);
  c->fd_ = fd;
  // Which server this is, so that a connection made again later can tell it from a new one.
  Result<Bytes> incarnation = c->read_incarnation();
  if (incarnation.ok()) {
    c->incarnation_ = std::move(*incarnation);
    return c;
  }
  if (incarnation.status().code() != StatusCode::kPermissionDenied) return incarnation.status();
  // Refused (a wrong token): on a connection of its own, so that the caller's first request
  // is refused as it would have been, with the server's reason.
  WL_ASSIGN_OR_RETURN(c->fd_, connect_with_retries(c->addresses_, c->where_, o.connect_timeout));
  return c;
}

Result<Bytes> TcpStore::read_incarnation() {
  StoreRequest r;
  r.op = StoreOp::kGet;
  r.token = options_.token;
  r.key = detail::kStoreIncarnationKey;
  const Bytes frame = detail::encode_request(r);
  const Deadline deadline = deadline_after(options_.request_timeout);
  Status s = detail::write_all(fd_, frame.data(), frame.size(), deadline, where_);
  auto response = s.ok() ? detail::read_response(fd_, deadline, where_) : Result<StoreResponse>(s);
  if (!response.ok()) {
    ::close(std::exchange(fd_, -1));
    return response.status();
  }
  if (response->code == StatusCode::kDeadlineExceeded) return Bytes{};  // a server without one
  if (response->code != StatusCode::kOk) {
    // Refused (the server closes a refused connection) or worse: this connection is done.
    ::close(std::exchange(fd_, -1));
    return Status(response->code, where_ + ": " + to_string(response->payload));
  }
  return std::move(response->payload);
}

Status TcpStore::reconnect() {
  const std::string again = where_ + ": connecting again after an earlier error";
  if (refused_) return unavailable(where_ + ": connection closed: the server refused our token");
  const std::string restarted =
      where_ + ": the server restarted since this client joined: the job's keys are gone";
  if (restarted_) return unavailable(restarted);
  std::chrono::milliseconds wait(0);
  if (handshake_fd_ < 0) {
    const SocketAddress& a = addresses_[next_address_++ % addresses_.size()];
    const int fd = ::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, a.protocol);
    if (fd < 0) return errno_status(again + ": socket", errno);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a.address), a.length) != 0 &&
        errno != EINPROGRESS) {
      const int err = errno;
      ::close(fd);
      return unavailable(again + ": " + std::strerror(err));
    }
    handshake_fd_ = fd;
    handshake_until_ = deadline_after(kReconnectTimeout);
    wait = kHandshakeWait;
  }
  pollfd pfd{handshake_fd_, POLLOUT, 0};
  const int rc = ::poll(&pfd, 1, int(wait.count()));
  int err = 0;
  socklen_t len = sizeof err;
  if (rc == 1) ::getsockopt(handshake_fd_, SOL_SOCKET, SO_ERROR, &err, &len);
  if (rc == 1 && err == 0) {
    fd_ = std::exchange(handshake_fd_, -1);
    set_nodelay(fd_);
    if (incarnation_.empty()) return ok_status();
    Result<Bytes> now = read_incarnation();
    if (!now.ok()) {
      if (now.status().code() == StatusCode::kPermissionDenied) refused_ = true;
      return unavailable(again + ": " + now.status().to_string());
    }
    if (*now == incarnation_) return ok_status();
    ::close(std::exchange(fd_, -1));
    restarted_ = true;
    return unavailable(restarted);
  }
  if (rc == 1 || Clock::now() >= handshake_until_) {
    ::close(std::exchange(handshake_fd_, -1));
    return unavailable(
        again + ": " +
        (rc == 1 ? std::string(std::strerror(err))
                 : "no answer within " + std::to_string(kReconnectTimeout.count()) + " ms"));
  }
  return unavailable(again + ": the handshake is under way");
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  if (handshake_fd_ >= 0) ::close(handshake_fd_);
}

Result<Bytes> TcpStore::call(uint8_t op, std::string_view key, Bytes value,
                             std::chrono::milliseconds wait, bool* not_set) {
  if (not_set) *not_set = false;
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
  r.timeout_ms = uint32_t(std::clamp<int64_t>(wait.count(), 0, detail::kStoreMaxWaitMs));
  Bytes frame = detail::encode_request(r);
  queued_.fetch_add(1);
  MutexLock lock(mu_);
  queued_.fetch_sub(1);
  if (fd_ < 0) WL_RETURN_IF_ERROR(reconnect());
  const Deadline deadline = deadline_after(options_.request_timeout) + wait + kReplySlack;
  Status s = detail::write_all(fd_, frame.data(), frame.size(), deadline, where_);
  auto response = s.ok() ? detail::read_response(fd_, deadline, where_) : Result<StoreResponse>(s);
  if (!response.ok()) {
    // The stream may be out of step; no later request may read this one's reply.
    ::close(fd_);
    fd_ = -1;
    return response.status();
  }
  if (response->code == StatusCode::kDeadlineExceeded) {
    // Nobody set the key in time (a peer that never joined, or died first): a timeout, not
    // a refusal; the server's message names the key and the wait.
    if (not_set) *not_set = true;
    return deadline_exceeded(where_ + ": " + to_string(response->payload));
  }
  if (response->code != StatusCode::kOk) {
    if (response->code == StatusCode::kPermissionDenied) {
      ::close(fd_);
      fd_ = -1;
      refused_ = true;
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
  // The connection carries one request at a time, so a long wait goes to the server in
  // slices: between two, a request of another thread of this process (queued on mu_) goes
  // first. Each slice still waits at the server, so a set is seen the moment it lands.
  using std::chrono::milliseconds;
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + std::min(timeout, milliseconds(kMaxGetMs));
  for (;;) {
    const auto left =
        std::max(milliseconds(0), std::chrono::ceil<milliseconds>(end - Clock::now()));
    const milliseconds slice = std::min(left, kGetSlice);
    bool not_set = false;
    Result<Bytes> value = call(uint8_t(StoreOp::kGet), key, {}, slice, &not_set);
    if (!not_set) return value;  // the value, or the connection's own failure
    if (slice >= left) {
      return deadline_exceeded(where_ + ": rendezvous key '" + std::string(key) +
                               "' was not set within " + std::to_string(timeout.count()) + " ms");
    }
    // The others' turn; bounded, so a stream of them cannot hold this get past its end.
    while (queued_.load() > 0 && Clock::now() < end) std::this_thread::yield();
  }
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
