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

struct Engine {
  int fd = -1;
  std::string in;                          // bytes received, not yet a whole line
  std::optional<Receiver::ReadGuard> pin;  // the version it reads, while it reads it
};

// The first message: what the mapping holds and where.
std::string hello_line(const Receiver& r) {
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
  return j.dump() + "\n";
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
  void accept_engines();
  // False when the engine must go (it closed, sent garbage too long, or stopped reading).
  bool read_from(Engine& e);
  bool answer(Engine& e, const std::string& line);
  static bool send_line(const Engine& e, const std::string& line);
};

bool Sidecar::Impl::send_line(const Engine& e, const std::string& line) {
  // A whole line or the engine goes: one that does not read its messages must not make the
  // sidecar wait (its socket buffer holds thousands of these lines before this happens).
  const ssize_t n = ::send(e.fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return n == ssize_t(line.size());
}

bool Sidecar::Impl::answer(Engine& e, const std::string& line) {
  if (line == "pin") {
    if (e.pin) {
      return send_line(e, json({{"error", "already pinned version " +
                                              std::to_string(e.pin->version()) + "; unpin first"}})
                                  .dump() +
                              "\n");
    }
    e.pin.emplace(receiver->acquire());
    return send_line(e,
                     json({{"pinned", e.pin->version()}, {"slot", e.pin->slot()}}).dump() + "\n");
  }
  if (line == "unpin") {
    if (!e.pin) return send_line(e, json({{"error", "nothing is pinned"}}).dump() + "\n");
    const uint64_t v = e.pin->version();
    e.pin.reset();
    return send_line(e, json({{"unpinned", v}}).dump() + "\n");
  }
  std::string shown = line.substr(0, 40);
  for (char& c : shown) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return send_line(
      e,
      json({{"error", "unknown request '" + shown + "': expected \"pin\" or \"unpin\""}}).dump() +
          "\n");
}

bool Sidecar::Impl::read_from(Engine& e) {
  char buf[kMaxLineBytes];
  const ssize_t n = ::recv(e.fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  e.in.append(buf, size_t(n));
  for (size_t nl = e.in.find('\n'); nl != std::string::npos; nl = e.in.find('\n')) {
    std::string line = e.in.substr(0, nl);
    e.in.erase(0, nl + 1);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (!answer(e, line)) return false;
  }
  if (e.in.size() > kMaxLineBytes) {
    send_line(e, json({{"error", "a request longer than " + std::to_string(kMaxLineBytes) +
                                     " bytes; disconnected"}})
                         .dump() +
                     "\n");
    return false;
  }
  return true;
}

void Sidecar::Impl::accept_engines() {
  for (;;) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN: no one else is waiting
    Engine e{.fd = fd};
    if (engines.size() >= size_t(kMaxSidecarClients)) {
      send_line(e, json({{"error", "this sidecar already serves " +
                                       std::to_string(kMaxSidecarClients) + " engines"}})
                           .dump() +
                       "\n");
      ::close(fd);
      continue;
    }
    if (!send_line(e, hello_line(*receiver))) {
      ::close(fd);
      continue;
    }
    engines.push_back(std::move(e));
  }
}

void Sidecar::Impl::run() {
  announced = receiver->version();
  while (!stop.load()) {
    std::vector<pollfd> fds = {{.fd = wake_fd, .events = POLLIN},
                               {.fd = listen_fd, .events = POLLIN}};
    for (const Engine& e : engines) fds.push_back({.fd = e.fd, .events = POLLIN});
    ::poll(fds.data(), fds.size(), kLookMs);
    if (fds[0].revents & POLLIN) {
      uint64_t drained = 0;
      (void)!::read(wake_fd, &drained, sizeof drained);
    }
    if (stop.load()) break;
    std::vector<bool> keep(engines.size(), true);
    for (size_t i = 0; i < engines.size(); ++i) {
      if (fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) keep[i] = read_from(engines[i]);
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
    if (fds[1].revents & POLLIN) accept_engines();
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
  // Only this user's engines may pin (and so hold up) this receiver.
  ::chmod(path.c_str(), 0600);
  impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0 || ::listen(impl->listen_fd, 16) != 0) {
    const Status s = errno_status("sidecar: listen on '" + printable(path) + "'", errno);
    if (impl->wake_fd >= 0) ::close(impl->wake_fd);
    ::close(impl->listen_fd);
    ::unlink(path.c_str());
    return s;
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
