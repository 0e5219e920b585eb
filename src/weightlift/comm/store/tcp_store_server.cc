// The TCP store's server: one thread, one epoll loop over every connection.
//
// Why a loop and not a thread per connection: a peer on MASTER_PORT that opens connections
// and sends nothing must not cost a thread each (2,000 idle connections once made 2,004
// threads), and a peer that declares a 64 MiB value must not cost 64 MiB before it has shown
// the job's token (forty forged headers once took a rank from 84 MB to 2.7 GB). So:
//   - each connection is a RequestReader (detail/store_wire.h): header checked first, token
//     read into a buffer of at most 1 KiB and compared, key and value read only after that,
//     growing with the bytes that arrive;
//   - a connection is read only up to the end of its current request, answered, then read
//     again; a get for a key not yet set parks the connection until a set or its deadline;
//   - deadlines: the handshake (first header and token) from accept, each request from its
//     first byte, each reply from its first byte; whoever misses one is closed (a waiting get
//     that misses its own wait is answered DeadlineExceeded, as the protocol says);
//   - connections are bounded: past the bound, the oldest connection that never presented the
//     token is closed for the newcomer, so a flood cannot lock the job's own ranks out; when
//     the process runs out of descriptors the same happens, or the newcomer is accepted and
//     closed at once (a spare descriptor is kept for that), never a loop that spins on accept.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>

#include "weightlift/comm/store/detail/store_wire.h"
#include "weightlift/comm/store/tcp_store.h"

namespace wl::comm {

namespace {

using detail::RequestReader;
using detail::StoreOp;
using detail::StoreRequest;
using detail::StoreResponse;
using TimePoint = Clock::time_point;

constexpr TimePoint kNever = TimePoint::max();

// Descriptors the loop may give to connections: 4096, or what RLIMIT_NOFILE leaves after 256
// for the rest of the process (UCX endpoints, files, pipes).
int default_max_connections() {
  struct rlimit r;
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 4096;
  return int(std::clamp<int64_t>(int64_t(r.rlim_cur) - 256, 16, 4096));
}

struct Connection {
  enum class State { kReading, kWaiting, kWriting };
  int fd = -1;
  RequestReader reader;
  TimePoint accepted;
  TimePoint deadline = kNever;  // closed (or, waiting, answered) when it passes
  State state = State::kReading;
  std::string waiting_key;  // kWaiting: the key its get waits for
  uint32_t waiting_ms = 0;
  Bytes out;  // kWriting: the reply
  size_t sent = 0;
  bool close_after = false;
};

}  // namespace

struct TcpStoreServer::Loop {
  TcpStoreServerOptions o;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1, spare_fd = -1;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<size_t> open{0};
  std::atomic<size_t> waiting{0};  // waiters.size(), for other threads
  // Everything below belongs to the loop's thread.
  std::map<int, std::unique_ptr<Connection>> conns;
  std::map<std::string, Bytes, std::less<>> values;
  uint64_t stored = 0;  // bytes of keys and values
  std::multimap<std::string, int, std::less<>> waiters;

  ~Loop();
  void run();
  void accept_ready();
  bool evict_one_stranger();
  void on_event(Connection& c, uint32_t events);
  void read_some(Connection& c);
  void handle(Connection& c, StoreRequest& r);
  void respond(Connection& c, StatusCode code, Bytes payload, bool close_after = false);
  void write_some(Connection& c);
  void wake(std::string_view key);
  void expire();
  int next_timeout_ms() const;
  void watch(Connection& c, uint32_t events);
  void close(int fd);
  void stop_waiting(Connection& c);
  Status set(const std::string& key, Bytes value);
  Result<int64_t> add(const std::string& key, const Bytes& delta);
};

TcpStoreServer::Loop::~Loop() {
  for (auto& [fd, c] : conns) ::close(fd);
  for (int fd : {listen_fd, epoll_fd, wake_fd, spare_fd})
    if (fd >= 0) ::close(fd);
}

void TcpStoreServer::Loop::run() {
  epoll_event events[64];
  while (!stopping.load()) {
    const int n = ::epoll_wait(epoll_fd, events, 64, next_timeout_ms());
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == listen_fd) {
        accept_ready();
      } else if (fd != wake_fd) {
        auto it = conns.find(fd);  // an earlier event of this batch may have closed it
        if (it != conns.end()) on_event(*it->second, events[i].events);
      }
    }
    expire();
  }
}

int TcpStoreServer::Loop::next_timeout_ms() const {
  TimePoint next = Clock::now() + std::chrono::seconds(1);
  for (const auto& [fd, c] : conns) next = std::min(next, c->deadline);
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
  return int(std::clamp<int64_t>(ms, 0, 1000));
}

void TcpStoreServer::Loop::watch(Connection& c, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = c.fd;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
}

// A waiting connection leaves the waiters of its key (it hung up, or its wait ran out).
void TcpStoreServer::Loop::stop_waiting(Connection& c) {
  auto [b, e] = waiters.equal_range(c.waiting_key);
  for (auto w = b; w != e; ++w) {
    if (w->second == c.fd) {
      waiters.erase(w);
      break;
    }
  }
  waiting = waiters.size();
  c.state = Connection::State::kReading;
}

void TcpStoreServer::Loop::close(int fd) {
  auto it = conns.find(fd);
  if (it == conns.end()) return;
  Connection& c = *it->second;
  if (c.state == Connection::State::kWaiting) stop_waiting(c);
  ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
  conns.erase(it);
  open.store(conns.size());
}

// The connection that has waited longest without presenting the token, closed.
bool TcpStoreServer::Loop::evict_one_stranger() {
  Connection* oldest = nullptr;
  for (auto& [fd, c] : conns) {
    if (!c->reader.authenticated() && (!oldest || c->accepted < oldest->accepted)) oldest = c.get();
  }
  if (!oldest) return false;
  close(oldest->fd);
  return true;
}

void TcpStoreServer::Loop::accept_ready() {
  const int max = o.max_connections > 0 ? o.max_connections : default_max_connections();
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
      if (evict_one_stranger()) continue;
      // Nothing to evict: take the newcomer with the spare descriptor and close it, rather
      // than leave it in the backlog for epoll to report again and again.
      ::close(spare_fd);
      fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) ::close(fd);
      spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      continue;
    }
    if (fd < 0 && (errno == ECONNABORTED || errno == EINTR)) continue;
    if (fd < 0) return;  // EAGAIN: no more now
    if (int(conns.size()) >= max && !evict_one_stranger()) {
      ::close(fd);  // full of the job's own connections
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto c = std::make_unique<Connection>(Connection{.fd = fd, .reader = RequestReader(o.token)});
    c->accepted = Clock::now();
    c->deadline = c->accepted + o.handshake_timeout;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
    conns.emplace(fd, std::move(c));
    open.store(conns.size());
  }
}

void TcpStoreServer::Loop::on_event(Connection& c, uint32_t events) {
  switch (c.state) {
    case Connection::State::kReading:
      if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_some(c);
      return;
    case Connection::State::kWaiting:
      // Gone, or speaking out of turn while its get waits: either way the stream is over.
      close(c.fd);
      return;
    case Connection::State::kWriting:
      if (events & (EPOLLHUP | EPOLLERR)) {
        close(c.fd);
      } else if (events & EPOLLOUT) {
        write_some(c);
      }
      return;
  }
}

// Reads up to the end of one request, then handles it; the next request is read after the
// reply has gone.
void TcpStoreServer::Loop::read_some(Connection& c) {
  std::byte buf[65536];
  for (;;) {
    const size_t want = std::min(c.reader.wanted(), sizeof buf);
    const ssize_t n = ::recv(c.fd, buf, want, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      close(c.fd);  // hung up (or broke) between or inside requests
      return;
    }
    if (n < 0) return;  // EAGAIN: the rest later
    const bool began = c.reader.mid_request();
    auto r = c.reader.consume(std::span(buf, size_t(n)));
    if (!r.ok()) {
      // The stream is out of step (or the peer is a stranger): say why, in the peer's own
      // version when it has one, then close.
      respond(c, r.status().code(), to_bytes(r.status().message()), /*close_after=*/true);
      return;
    }
    if (r->has_value()) {
      handle(c, **r);
      return;
    }
    // A request has begun: it must now arrive whole in time (the handshake's own deadline,
    // if sooner, still holds).
    if (!began) c.deadline = std::min(c.deadline, Clock::now() + o.request_timeout);
  }
}

Status TcpStoreServer::Loop::set(const std::string& key, Bytes value) {
  auto it = values.find(key);
  const uint64_t before = it == values.end() ? 0 : key.size() + it->second.size();
  const uint64_t after = stored - before + key.size() + value.size();
  if (after > o.max_stored_bytes) {
    return resource_exhausted("rendezvous store holds " + std::to_string(stored) +
                              " bytes; setting '" + key + "' would pass its limit of " +
                              std::to_string(o.max_stored_bytes));
  }
  stored = after;
  values[key] = std::move(value);
  return ok_status();
}

Result<int64_t> TcpStoreServer::Loop::add(const std::string& key, const Bytes& delta) {
  int64_t d = 0, now = 0;
  std::memcpy(&d, delta.data(), 8);  // the reader has checked that it is 8 bytes
  auto it = values.find(key);
  if (it != values.end()) {
    if (it->second.size() != 8) {
      return invalid_argument("rendezvous key '" + key + "' holds a value that is not a counter");
    }
    std::memcpy(&now, it->second.data(), 8);
  }
  now = int64_t(uint64_t(now) + uint64_t(d));  // wraps as two's complement, never UB
  Bytes v(8);
  std::memcpy(v.data(), &now, 8);
  WL_RETURN_IF_ERROR(set(key, std::move(v)));
  return now;
}

void TcpStoreServer::Loop::handle(Connection& c, StoreRequest& r) {
  c.deadline = kNever;
  Status s;
  Bytes payload;
  if (r.op != StoreOp::kGet && r.key == detail::kStoreIncarnationKey) {
    // The server's own key: a client that overwrote it would make every reconnecting client
    // take this server for a new one.
    respond(c, StatusCode::kInvalidArgument,
            to_bytes("'" + r.key + "' is the server's reserved key; clients may only read it"));
    return;
  }
  switch (r.op) {
    case StoreOp::kSet:
      s = set(r.key, std::move(r.value));
      break;
    case StoreOp::kAdd: {
      Result<int64_t> now = add(r.key, r.value);
      s = now.status();
      if (now.ok()) {
        payload.resize(8);
        std::memcpy(payload.data(), &*now, 8);
      }
      break;
    }
    case StoreOp::kGet: {
      auto it = values.find(r.key);
      if (it != values.end()) {
        payload = it->second;
      } else {
        // Parked until a set, or until its own wait runs out (answered in expire()).
        c.state = Connection::State::kWaiting;
        c.waiting_key = r.key;
        c.waiting_ms = r.timeout_ms;
        c.deadline = Clock::now() + std::chrono::milliseconds(r.timeout_ms);
        waiters.emplace(r.key, c.fd);
        waiting = waiters.size();
        watch(c, EPOLLIN | EPOLLRDHUP);
        return;
      }
      break;
    }
  }
  if (s.ok()) {
    respond(c, StatusCode::kOk, std::move(payload));
    if (r.op != StoreOp::kGet) wake(r.key);
  } else {
    respond(c, s.code(), to_bytes(s.message()));
  }
}

void TcpStoreServer::Loop::wake(std::string_view key) {
  auto it = values.find(key);
  if (it == values.end()) return;
  auto [b, e] = waiters.equal_range(key);
  std::vector<int> fds;
  for (auto w = b; w != e; ++w) fds.push_back(w->second);
  waiters.erase(b, e);
  waiting = waiters.size();
  for (int fd : fds) {
    auto c = conns.find(fd);
    if (c == conns.end()) continue;
    c->second->state = Connection::State::kReading;  // no longer among the waiters
    respond(*c->second, StatusCode::kOk, it->second);
  }
}

void TcpStoreServer::Loop::respond(Connection& c, StatusCode code, Bytes payload,
                                   bool close_after) {
  StoreResponse r;  // in our own version, which a peer of another one reports as such
  r.code = code;
  r.payload = std::move(payload);
  c.out = detail::encode_response(r);
  c.sent = 0;
  c.close_after = close_after;
  c.state = Connection::State::kWriting;
  c.deadline = Clock::now() + o.request_timeout;
  write_some(c);
}

void TcpStoreServer::Loop::write_some(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      watch(c, EPOLLOUT);  // the rest when the peer has read some
      return;
    }
    if (n < 0) {
      close(c.fd);
      return;
    }
    c.sent += size_t(n);
  }
  if (c.close_after) {
    close(c.fd);
    return;
  }
  c.out = Bytes();
  c.state = Connection::State::kReading;
  c.deadline = kNever;  // the job's own ranks may be idle between requests for hours
  watch(c, EPOLLIN | EPOLLRDHUP);
}

void TcpStoreServer::Loop::expire() {
  const TimePoint now = Clock::now();
  std::vector<int> due;
  for (const auto& [fd, c] : conns)
    if (c->deadline <= now) due.push_back(fd);
  for (int fd : due) {
    auto it = conns.find(fd);
    if (it == conns.end()) continue;
    Connection& c = *it->second;
    if (c.state != Connection::State::kWaiting) {
      close(fd);  // silent past its handshake, too slow with a request, or not reading a reply
      continue;
    }
    stop_waiting(c);
    respond(c, StatusCode::kDeadlineExceeded,
            to_bytes("rendezvous key '" + c.waiting_key + "' was not set within " +
                     std::to_string(c.waiting_ms) + " ms"));
  }
}

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(const TcpStoreServerOptions& o) {
  std::unique_ptr<TcpStoreServer> s(new TcpStoreServer());
  s->loop_ = std::make_unique<Loop>();
  Loop& l = *s->loop_;
  l.o = o;
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
    int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      last = errno_status(where + ": socket", errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      last = errno_status(where + ": bind/listen", errno);
      ::close(fd);
      continue;
    }
    l.listen_fd = fd;
    break;
  }
  ::freeaddrinfo(res);
  if (l.listen_fd < 0) return last;
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(l.listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  l.port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  l.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  l.wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  l.spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (l.epoll_fd < 0 || l.wake_fd < 0 || l.spare_fd < 0)
    return errno_status(where + ": epoll", errno);
  for (int fd : {l.listen_fd, l.wake_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    ::epoll_ctl(l.epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  }
  // This server's incarnation (detail::kStoreIncarnationKey), before any client can ask.
  std::random_device device;
  const uint64_t incarnation =
      (uint64_t(device()) << 32) ^ uint64_t(device()) ^
      uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  Bytes value(8);
  std::memcpy(value.data(), &incarnation, 8);
  l.values[detail::kStoreIncarnationKey] = std::move(value);  // not the clients' bytes
  s->thread_ = std::thread([loop = s->loop_.get()] { loop->run(); });
  return s;
}

TcpStoreServer::~TcpStoreServer() {
  if (!loop_) return;
  loop_->stopping.store(true);
  const uint64_t one = 1;
  ssize_t ignored = ::write(loop_->wake_fd, &one, sizeof one);
  (void)ignored;
  if (thread_.joinable()) thread_.join();
}

int TcpStoreServer::port() const { return loop_->port; }

size_t TcpStoreServer::connections() const { return loop_->open.load(); }
size_t TcpStoreServer::waiting() const { return loop_->waiting.load(); }

}  // namespace wl::comm
