// The C API of fleet/attach.h: the engine's side of the sidecar protocol (fleet/sidecar.h).
// Self-contained on purpose (libc, libstdc++, nlohmann's header): an engine links this and
// nothing else of weightlift.
#include "weightlift/transfer/fleet/attach.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

struct wl_attached {
  struct Tensor {
    std::string name, dtype;
    std::vector<int64_t> shape;
    size_t offset = 0, bytes = 0;
  };
  int fd = -1;
  std::string in;  // received bytes, not yet a whole line
  uint64_t version = 0;
  size_t slot_bytes = 0;
  const std::byte* map = nullptr;
  size_t map_bytes = 0;
  std::vector<Tensor> tensors;
  std::optional<int> pinned_slot;
};

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

void set_error(char* err, size_t len, const std::string& what) {
  if (err == nullptr || len == 0) return;
  const size_t n = std::min(len - 1, what.size());
  std::memcpy(err, what.data(), n);
  err[n] = '\0';
}

std::optional<std::string> take_line(wl_attached& a) {
  const size_t nl = a.in.find('\n');
  if (nl == std::string::npos) return std::nullopt;
  std::string line = a.in.substr(0, nl);
  a.in.erase(0, nl + 1);
  return line;
}

// Reads what is there (waiting up to `wait_ms`, 0: not at all). False with `error` set when
// the connection is gone.
bool receive(wl_attached& a, int wait_ms, std::string& error) {
  pollfd p{.fd = a.fd, .events = POLLIN};
  if (::poll(&p, 1, wait_ms) <= 0) return true;
  char buf[65536];
  const ssize_t n = ::recv(a.fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    error = "the sidecar closed the connection";
    return false;
  }
  if (n > 0) a.in.append(buf, size_t(n));
  return true;
}

// The next message, a version announcement noted on the way. Empty with `error` set at the
// deadline or when the sidecar is gone.
std::optional<json> next_message(wl_attached& a, Clock::time_point deadline, std::string& error) {
  for (;;) {
    if (std::optional<std::string> line = take_line(a)) {
      json m = json::parse(*line, nullptr, false);
      if (!m.is_object()) {
        error = "the sidecar sent a line that is not a JSON object: " + line->substr(0, 60);
        return std::nullopt;
      }
      if (m.contains("version") && !m.contains("format") && m["version"].is_number_unsigned()) {
        a.version = std::max(a.version, m["version"].get<uint64_t>());
      }
      return m;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      error = "DeadlineExceeded: the sidecar did not answer in time";
      return std::nullopt;
    }
    if (!receive(a, int(std::min<int64_t>(left, 1000)), error)) return std::nullopt;
  }
}

// Sends `what` and waits for the message holding `answer` (or an error).
std::optional<json> request(wl_attached& a, const char* what, const char* answer, int timeout_ms,
                            std::string& error) {
  const std::string line = std::string(what) + "\n";
  if (::send(a.fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(line.size())) {
    error = std::string("sending '") + what + "' to the sidecar: " + std::strerror(errno);
    return std::nullopt;
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    std::optional<json> m = next_message(a, deadline, error);
    if (!m) {
      // Its answer may still come, and be taken for the next request's; and a pin the
      // sidecar granted meanwhile would be held with no one to release it. Closing the
      // connection releases it.
      ::shutdown(a.fd, SHUT_RDWR);
      error += " (connection closed)";
      return std::nullopt;
    }
    if (m->contains("error")) {
      error = std::string("the sidecar refused '") + what +
              "': " + (*m)["error"].dump(-1, ' ', false, json::error_handler_t::replace);
      return std::nullopt;
    }
    if (m->contains(answer)) return m;
  }
}

// Reads the first message into `a`. Throws nlohmann's exceptions on a malformed one.
void read_hello(wl_attached& a, const json& hello, std::string& shm, size_t& bytes) {
  a.version = hello.at("version").get<uint64_t>();
  a.slot_bytes = hello.at("slot_bytes").get<size_t>();
  bytes = hello.at("bytes").get<size_t>();
  shm = hello.at("shm").get<std::string>();
  for (const json& t : hello.at("tensors")) {
    wl_attached::Tensor x{.name = t.at("name").get<std::string>(),
                          .dtype = t.at("dtype").get<std::string>(),
                          .shape = t.at("shape").get<std::vector<int64_t>>(),
                          .offset = t.at("offset").get<size_t>(),
                          .bytes = t.at("bytes").get<size_t>()};
    if (x.offset + x.bytes > a.slot_bytes || a.slot_bytes * 2 > bytes) {
      throw std::out_of_range("tensor '" + x.name + "' lies outside the slot");
    }
    a.tensors.push_back(std::move(x));
  }
}

// Connects, reads the first message and maps the memory; the error otherwise.
std::string open_attached(wl_attached& a, const char* path, int timeout_ms) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path == nullptr || std::strlen(path) == 0 || std::strlen(path) >= sizeof addr.sun_path) {
    return "socket path: expected 1 to " + std::to_string(sizeof addr.sun_path - 1) + " characters";
  }
  std::memcpy(addr.sun_path, path, std::strlen(path));
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  a.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (a.fd < 0) return std::string("socket: ") + std::strerror(errno);
  // A full backlog (a sidecar that stopped accepting) is EAGAIN: tried again until the deadline.
  while (::connect(a.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EAGAIN || Clock::now() >= deadline) {
      return std::string("connecting: ") +
             (errno == EAGAIN ? "the sidecar accepts no one in time" : std::strerror(errno));
    }
    ::usleep(10000);
  }
  std::string error;
  std::optional<json> hello = next_message(a, deadline, error);
  if (!hello) return error;
  if (hello->contains("error") && (*hello)["error"].is_string()) {
    return "refused: " + (*hello)["error"].get<std::string>();
  }
  if (!(*hello)["format"].is_string() || (*hello)["format"] != "weightlift-sidecar" ||
      !(*hello)["format_version"].is_number_integer() || (*hello)["format_version"] != 1) {
    return "expected format weightlift-sidecar version 1, got " + hello->dump().substr(0, 80) +
           ": attach with the weightlift of the sidecar's build";
  }
  std::string shm;
  size_t bytes = 0;
  try {
    read_hello(a, *hello, shm, bytes);
  } catch (const std::exception& e) {
    return std::string("a malformed first message: ") + e.what();
  }
  const int fd = ::shm_open(shm.c_str(), O_RDONLY, 0);
  if (fd < 0) return "shared memory '" + shm + "': " + std::strerror(errno);
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) return "mapping shared memory '" + shm + "': " + std::strerror(err);
  a.map = static_cast<const std::byte*>(p);
  a.map_bytes = bytes;
  return "";
}

void describe(const wl_attached::Tensor& t, wl_tensor_info* info) {
  if (info == nullptr) return;
  *info = {.name = t.name.c_str(),
           .dtype = t.dtype.c_str(),
           .ndim = int(t.shape.size()),
           .shape = t.shape.data(),
           .bytes = t.bytes};
}

}  // namespace

extern "C" {

wl_attached* wl_attach(const char* socket_path, int timeout_ms, char* err, size_t err_len) {
  auto* a = new (std::nothrow) wl_attached();
  if (a == nullptr) {
    set_error(err, err_len, "out of memory");
    return nullptr;
  }
  std::string error;
  try {
    error = open_attached(*a, socket_path, timeout_ms);
  } catch (const std::exception& e) {  // nothing may cross into the engine's C
    error = e.what();
  }
  if (error.empty()) return a;
  set_error(err, err_len,
            "sidecar " + std::string(socket_path ? socket_path : "(null)") + ": " + error);
  wl_attach_close(a);
  return nullptr;
}

uint64_t wl_attach_version(wl_attached* a) {
  try {
    std::string ignored;
    for (;;) {
      while (a->in.find('\n') != std::string::npos) next_message(*a, Clock::now(), ignored);
      const size_t before = a->in.size();
      if (!receive(*a, 0, ignored) || a->in.size() == before) return a->version;
    }
  } catch (const std::exception&) {  // nothing may cross into the engine's C
    return a->version;
  }
}

int wl_attach_wait_version(wl_attached* a, uint64_t version, int timeout_ms, char* err,
                           size_t err_len) {
  try {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    std::string error;
    while (wl_attach_version(a) < version) {
      if (!next_message(*a, deadline, error)) {
        set_error(err, err_len,
                  error + " (waiting for version " + std::to_string(version) + ", holding " +
                      std::to_string(a->version) + ")");
        return -1;
      }
    }
    return 0;
  } catch (const std::exception& e) {  // nothing may cross into the engine's C
    set_error(err, err_len, e.what());
    return -1;
  }
}

int wl_attach_pin(wl_attached* a, int timeout_ms, uint64_t* version, char* err, size_t err_len) {
  try {
    std::string error;
    std::optional<json> m = request(*a, "pin", "pinned", timeout_ms, error);
    if (!m || !(*m)["slot"].is_number_integer() || !(*m)["pinned"].is_number_unsigned()) {
      set_error(err, err_len, m ? "a malformed answer to 'pin': " + m->dump() : error);
      return -1;
    }
    const int slot = (*m)["slot"].get<int>();
    if (slot != 0 && slot != 1) {
      set_error(err, err_len, "the sidecar pinned slot " + std::to_string(slot));
      return -1;
    }
    a->pinned_slot = slot;
    if (version != nullptr) *version = (*m)["pinned"].get<uint64_t>();
    return 0;
  } catch (const std::exception& e) {  // nothing may cross into the engine's C
    set_error(err, err_len, e.what());
    return -1;
  }
}

int wl_attach_unpin(wl_attached* a, int timeout_ms, char* err, size_t err_len) {
  try {
    std::string error;
    a->pinned_slot.reset();  // from here on the memory may change, whatever the answer
    if (!request(*a, "unpin", "unpinned", timeout_ms, error)) {
      set_error(err, err_len, error);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {  // nothing may cross into the engine's C
    set_error(err, err_len, e.what());
    return -1;
  }
}

int wl_attach_tensor_count(const wl_attached* a) { return int(a->tensors.size()); }

int wl_attach_tensor_at(const wl_attached* a, int i, wl_tensor_info* info) {
  if (i < 0 || size_t(i) >= a->tensors.size()) return -1;
  describe(a->tensors[size_t(i)], info);
  return 0;
}

const void* wl_attach_tensor(const wl_attached* a, const char* name, wl_tensor_info* info) {
  if (!a->pinned_slot || name == nullptr) return nullptr;
  for (const wl_attached::Tensor& t : a->tensors) {
    if (t.name != name) continue;
    describe(t, info);
    return a->map + size_t(*a->pinned_slot) * a->slot_bytes + t.offset;
  }
  return nullptr;
}

void wl_attach_close(wl_attached* a) {
  if (a == nullptr) return;
  if (a->fd >= 0) ::close(a->fd);
  if (a->map != nullptr) ::munmap(const_cast<std::byte*>(a->map), a->map_bytes);
  delete a;
}

}  // extern "C"
