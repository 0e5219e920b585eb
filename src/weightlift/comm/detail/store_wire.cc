#include "weightlift/comm/detail/store_wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace wl::comm::detail {

namespace {

// Little-endian fields; these machines are little-endian, and the format says so for others.
void put_u32(std::byte* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put_u64(std::byte* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get_u32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get_u64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

int remaining_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return int(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

Status check_magic(const std::byte* p, const std::string& what) {
  if (std::memcmp(p, kStoreMagic, 4) != 0) {
    return data_loss(what +
                     ": not a weightlift rendezvous store message (bad magic); is "
                     "something else listening on MASTER_PORT?");
  }
  return ok_status();
}

Status format_version_mismatch(uint8_t found, const std::string& what) {
  return failed_precondition(what + ": rendezvous store wire format version mismatch: expected " +
                             std::to_string(kStoreWireFormatVersion) + ", found " +
                             std::to_string(found) +
                             "; run the same weightlift build on every "
                             "rank");
}

}  // namespace

Bytes encode_request(const StoreRequest& r) {
  Bytes out(kStoreRequestHeaderBytes + r.token.size() + r.key.size() + r.value.size());
  std::byte* p = out.data();
  std::memcpy(p, kStoreMagic, 4);
  p[4] = std::byte(r.format_version);
  p[5] = std::byte(r.op);
  put_u32(p + 8, uint32_t(r.token.size()));
  put_u32(p + 12, uint32_t(r.key.size()));
  put_u64(p + 16, r.value.size());
  put_u32(p + 24, r.timeout_ms);
  size_t at = kStoreRequestHeaderBytes;
  std::memcpy(p + at, r.token.data(), r.token.size());
  at += r.token.size();
  std::memcpy(p + at, r.key.data(), r.key.size());
  at += r.key.size();
  if (!r.value.empty()) std::memcpy(p + at, r.value.data(), r.value.size());
  return out;
}

Bytes encode_response(const StoreResponse& r) {
  Bytes out(kStoreResponseHeaderBytes + r.payload.size());
  std::byte* p = out.data();
  std::memcpy(p, kStoreMagic, 4);
  p[4] = std::byte(r.format_version);
  p[5] = std::byte(r.code);
  put_u64(p + 8, r.payload.size());
  if (!r.payload.empty()) std::memcpy(p + 16, r.payload.data(), r.payload.size());
  return out;
}

Status write_all(int fd, const void* data, size_t bytes, Deadline deadline,
                 const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    pollfd pfd{fd, POLLOUT, 0};
    int n = ::poll(&pfd, 1, remaining_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(what + ": poll", errno);
    if (n == 0) return deadline_exceeded(what + ": send timed out");
    ssize_t w = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (w < 0) return errno_status(what + ": send", errno);
    p += w;
    bytes -= size_t(w);
  }
  return ok_status();
}

Status read_exact(int fd, void* data, size_t bytes, Deadline deadline, const std::string& what) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int n = ::poll(&pfd, 1, remaining_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(what + ": poll", errno);
    if (n == 0) return deadline_exceeded(what + ": no reply before the deadline");
    ssize_t r = ::recv(fd, p, bytes, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r < 0) return errno_status(what + ": recv", errno);
    if (r == 0) return unavailable(what + ": connection closed by the other side");
    p += r;
    bytes -= size_t(r);
  }
  return ok_status();
}

Result<StoreRequest> read_request(int fd, Deadline deadline, const std::string& what,
                                  uint8_t* format_version_out) {
  std::byte h[kStoreRequestHeaderBytes];
  WL_RETURN_IF_ERROR(read_exact(fd, h, sizeof h, deadline, what));
  WL_RETURN_IF_ERROR(check_magic(h, what));
  StoreRequest r;
  r.format_version = uint8_t(h[4]);
  *format_version_out = r.format_version;
  if (r.format_version != kStoreWireFormatVersion)
    return format_version_mismatch(r.format_version, what);
  r.op = StoreOp(uint8_t(h[5]));
  if (r.op != StoreOp::kSet && r.op != StoreOp::kGet && r.op != StoreOp::kAdd) {
    return invalid_argument(what + ": unknown store operation " + std::to_string(int(h[5])));
  }
  const uint32_t token_len = get_u32(h + 8), key_len = get_u32(h + 12);
  const uint64_t value_len = get_u64(h + 16);
  r.timeout_ms = get_u32(h + 24);
  if (token_len > kStoreMaxTokenBytes || key_len > kStoreMaxKeyBytes ||
      value_len > kStoreMaxValueBytes) {
    return invalid_argument(what + ": request too large (token " + std::to_string(token_len) +
                            ", key " + std::to_string(key_len) + ", value " +
                            std::to_string(value_len) + " bytes)");
  }
  r.token.resize(token_len);
  r.key.resize(key_len);
  r.value.resize(value_len);
  WL_RETURN_IF_ERROR(read_exact(fd, r.token.data(), token_len, deadline, what));
  WL_RETURN_IF_ERROR(read_exact(fd, r.key.data(), key_len, deadline, what));
  WL_RETURN_IF_ERROR(read_exact(fd, r.value.data(), value_len, deadline, what));
  return r;
}

Result<StoreResponse> read_response(int fd, Deadline deadline, const std::string& what) {
  std::byte h[kStoreResponseHeaderBytes];
  WL_RETURN_IF_ERROR(read_exact(fd, h, sizeof h, deadline, what));
  WL_RETURN_IF_ERROR(check_magic(h, what));
  StoreResponse r;
  r.format_version = uint8_t(h[4]);
  r.code = StatusCode(uint8_t(h[5]));
  const uint64_t len = get_u64(h + 8);
  if (len > kStoreMaxValueBytes) {
    return data_loss(what + ": reply of " + std::to_string(len) + " bytes is too large");
  }
  r.payload.resize(len);
  WL_RETURN_IF_ERROR(read_exact(fd, r.payload.data(), len, deadline, what));
  if (r.format_version != kStoreWireFormatVersion)
    return format_version_mismatch(r.format_version, what);
  return r;
}

}  // namespace wl::comm::detail
