// Sidecar: the socket side of fleet/sidecar.h. One thread polls the listening socket, the
// engines' connections and an eventfd (notify() and the destructor write it).
#include "weightlift/transfer/fleet/sidecar.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

namespace wl::transfer {
namespace {

using nlohmann::json;

constexpr size_t kMaxLineBytes = 4096;
constexpr int kLookMs = 50;  // how often the thread looks at the version without a notify()
// What may wait to be sent to one engine: the first message (about 120 bytes per tensor, so
// 0.3 MB for seed-6.9b in fp8) and, behind it, lines of a few dozen bytes. An engine that lets
// more than this pile up has stopped reading.
constexpr size_t kMaxQueuedBytes = size_t(64) << 20;

struct Engine {
  int fd = -1;
  std::string in;                          // bytes received, not yet a whole line
  std::string out;                         // bytes to send, in order
  std::optional<Receiver::ReadGuard> pin;  // the version it reads, while it reads it
};

// The first message: what the mapping holds and where.
json hello(const Receiver& r) {
  json j = {{"format", "weightlift-sidecar"},   {"format_version", 1},
            {"shm", r.options().shared_memory}, {"slot_bytes", r.slot_bytes()},
            {"bytes", 2 * r.slot_bytes()},      {"version", r.version()}};
  json tensors = json::array();
  for (const ReceiverEntry& e : r.entries()) {
    tensors.push_back({{"name", e.spec.name},
                       {"dtype", std::string(dtype_name(e.spec.dtype))},
                       {"shape", e.spec.shape},
                       {"offset", e.offset},
                       {"bytes", e.bytes}});
  }
  j["tensors"] = std::move(tensors);
  return j;
}

}  // namespace

struct Sidecar::Impl {
  const Receiver* receiver = nullptr;
  std::string socket_path;
  int listen_fd = -1;
  int wake_fd = -1;
  std::atomic<bool> stop{false};
  std::atomic<int> connected{0};
  std::thread thread;
  // The thread's own state.
  std::vector<Engine> engines;
  uint64_t announced = 0;

  void run();
  bool accept_engines();  // false: accepting failed for want of descriptors
  // False when the engine must go (it closed, sent garbage too long, or stopped reading).
  bool read_from(Engine& e);
  bool answer(Engine& e, const std::string& line);
  // Queues `line` and sends what the socket takes now; false when the engine must go.
  static bool send_line(Engine& e, const std::string& line);
  static bool send(Engine& e, const json& message) { return send_line(e, message.dump() + "\n"); }
  static bool send_error(Engine& e, const std::string& what) { return send(e, {{"error", what}}); }
  static bool flush(Engine& e);
};

bool Sidecar::Impl::flush(Engine& e) {
  while (!e.out.empty()) {
    const ssize_t n = ::send(e.fd, e.out.data(), e.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    e.out.erase(0, size_t(n));
  }
  return true;
}

bool Sidecar::Impl::send_line(Engine& e, const std::string& line) {
  // Never a blocking send: an engine that does not read its messages must not make the
  // sidecar wait. Its queue grows instead, up to a bound.
  if (e.out.size() + line.size() > kMaxQueuedBytes) return false;
  e.out += line;
  return flush(e);
}

bool Sidecar::Impl::answer(Engine& e, const std::string& line) {
  if (line == "pin") {
    if (e.pin) {
      return send_error(
          e, "already pinned version " + std::to_string(e.pin->version()) + "; unpin first");
    }
    if (receiver->version() == 0) {
      // Nothing to read, and the first update writes either slot.
      return send_error(e, "nothing received yet: wait for version 1");
    }
    e.pin.emplace(receiver->acquire());
    return send(e, {{"pinned", e.pin->version()}, {"slot", e.pin->slot()}});
  }
  if (line == "unpin") {
    if (!e.pin) return send_error(e, "nothing is pinned");
    const uint64_t v = e.pin->version();
    e.pin.reset();
    return send(e, {{"unpinned", v}});
  }
  std::string shown = line.substr(0, 40);
  for (char& c : shown) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return send_error(e, "unknown request '" + shown + "': expected \"pin\" or \"unpin\"");
}

bool Sidecar::Impl::read_from(Engine& e) {
  char buf[kMaxLineBytes];
  const ssize_t n = ::recv(e.fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  e.in.append(buf, size_t(n));
  for (size_t nl = e.in.find('\n'); nl != std::string::npos; nl = e.in.find('\n')) {
    if (nl > kMaxLineBytes) break;  // too long, whether or not its end has come
    std::string line = e.in.substr(0, nl);
    e.in.erase(0, nl + 1);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (!answer(e, line)) return false;
  }
  // What is left has no newline, or one past the limit (the loop stopped there).
  if (e.in.size() > kMaxLineBytes) {
    send_error(e,
               "a request longer than " + std::to_string(kMaxLineBytes) + " bytes; disconnected");
    return false;
  }
  return true;
}

bool Sidecar::Impl::accept_engines() {
  for (;;) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    // EAGAIN: no one else is waiting. Anything else (out of descriptors) leaves the engine in
    // the backlog; the caller stops listening for one look rather than spin on it.
    if (fd < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    Engine e{.fd = fd};
    if (engines.size() >= size_t(kMaxSidecarClients)) {
      send_error(e,
                 "this sidecar already serves " + std::to_string(kMaxSidecarClients) + " engines");
      ::close(fd);
      continue;
    }
    if (!send(e, hello(*receiver))) {
      ::close(fd);
      continue;
    }
    engines.push_back(std::move(e));
  }
}

void Sidecar::Impl::run() {
  announced = receiver->version();
  bool listening = true;
  while (!stop.load()) {
    std::vector<pollfd> fds = {{.fd = wake_fd, .events = POLLIN},
                               {.fd = listening ? listen_fd : -1, .events = POLLIN}};
    for (const Engine& e : engines) {
      fds.push_back({.fd = e.fd, .events = short(POLLIN | (e.out.empty() ? 0 : POLLOUT))});
    }
    listening = true;
    ::poll(fds.data(), fds.size(), kLookMs);
    if (fds[0].revents & POLLIN) {
      uint64_t drained = 0;
      (void)!::read(wake_fd, &drained, sizeof drained);
    }
    if (stop.load()) break;
    std::vector<bool> keep(engines.size(), true);
    for (size_t i = 0; i < engines.size(); ++i) {
      const short ev = fds[i + 2].revents;
      if (ev & (POLLIN | POLLHUP | POLLERR)) keep[i] = read_from(engines[i]);
      if (keep[i] && (ev & POLLOUT)) keep[i] = flush(engines[i]);
    }
    const uint64_t v = receiver->version();
    if (v != announced) {
      announced = v;
      const std::string line = json({{"version", v}}).dump() + "\n";
      for (size_t i = 0; i < engines.size(); ++i) {
        if (keep[i]) keep[i] = send_line(engines[i], line);
      }
    }
    std::vector<Engine> kept;
    for (size_t i = 0; i < engines.size(); ++i) {
      if (keep[i]) {
        kept.push_back(std::move(engines[i]));
      } else {
        ::close(engines[i].fd);  // its pin goes with it
      }
    }
    engines = std::move(kept);
    if (fds[1].revents & POLLIN) listening = accept_engines();
    connected.store(int(engines.size()));
  }
  for (Engine& e : engines) ::close(e.fd);
  engines.clear();
  connected.store(0);
}

Result<std::unique_ptr<Sidecar>> Sidecar::start(const Receiver& receiver,
                                                const SidecarOptions& options) {
  if (receiver.options().shared_memory.empty()) {
    return failed_precondition(
        "sidecar: the receiver's weights are not in shared memory (ReceiverOptions::"
        "shared_memory); no other process could map them");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& path = options.socket_path;
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    return invalid_argument("sidecar: socket path '" + printable(path) + "': expected 1 to " +
                            std::to_string(sizeof addr.sun_path - 1) + " characters");
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  auto impl = std::make_unique<Impl>();
  impl->receiver = &receiver;
  impl->listen_fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (impl->listen_fd < 0) return errno_status("sidecar: socket", errno);
  if (::bind(impl->listen_fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(impl->listen_fd);
    if (err == EADDRINUSE) {
      return failed_precondition("sidecar: socket '" + printable(path) +
                                 "' already exists: another sidecar's, or left by one that was "
                                 "killed (remove it if none runs)");
    }
    return errno_status("sidecar: bind '" + printable(path) + "'", err);
  }
  impl->socket_path = path;
  Status failed = ok_status();
  // Only this user's engines may pin (and so hold up) this receiver.
  if (::chmod(path.c_str(), 0600) != 0) {
    failed = errno_status("sidecar: chmod 0600 '" + printable(path) + "'", errno);
  } else if ((impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
    failed = errno_status("sidecar: eventfd", errno);
  } else if (::listen(impl->listen_fd, 16) != 0) {
    failed = errno_status("sidecar: listen on '" + printable(path) + "'", errno);
  }
  if (!failed.ok()) {
    if (impl->wake_fd >= 0) ::close(impl->wake_fd);
    ::close(impl->listen_fd);
    ::unlink(path.c_str());
    return failed;
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<Sidecar>(new Sidecar(std::move(impl)));
}

Sidecar::Sidecar(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Sidecar::~Sidecar() {
  impl_->stop.store(true);
  notify();
  impl_->thread.join();
  ::close(impl_->wake_fd);
  ::close(impl_->listen_fd);
  ::unlink(impl_->socket_path.c_str());
}

void Sidecar::notify() {
  const uint64_t one = 1;
  (void)!::write(impl_->wake_fd, &one, sizeof one);
}

int Sidecar::engines() const { return impl_->connected.load(); }

}  // namespace wl::transfer
