#include "weightlift/comm/store/detail/store_wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "weightlift/core/check.h"

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

// ---- RequestReader -------------------------------------------------------------------------

namespace {

// Constant-time comparison, so the time a refusal takes says nothing about the token.
bool same_token(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

const std::string kPeer = "rendezvous store client";

}  // namespace

size_t RequestReader::wanted() const {
  if (spent_) return 0;
  switch (part_) {
    case Part::kHeader:
      return kStoreRequestHeaderBytes - got_;
    case Part::kToken:
      return token_len_ - got_;
    case Part::kKey:
      return key_len_ - got_;
    case Part::kValue:
      return size_t(value_len_ - got_);
  }
  return 0;
}

size_t RequestReader::buffered_bytes() const {
  return sizeof header_ + presented_.capacity() + request_.key.capacity() +
         request_.value.capacity();
}

// The header is whole: everything it declares is checked before anything is read for it.
Status RequestReader::start_request() {
  const std::byte* h = header_;
  WL_RETURN_IF_ERROR(check_magic(h, kPeer));
  version_seen_ = uint8_t(h[4]);
  if (version_seen_ != kStoreWireFormatVersion)
    return format_version_mismatch(version_seen_, kPeer);
  request_ = StoreRequest{};
  request_.op = StoreOp(uint8_t(h[5]));
  token_len_ = get_u32(h + 8);
  key_len_ = get_u32(h + 12);
  value_len_ = get_u64(h + 16);
  request_.timeout_ms = get_u32(h + 24);
  const bool reserved_zero = h[6] == std::byte(0) && h[7] == std::byte(0) && get_u32(h + 28) == 0;
  const std::string sizes = "(token " + std::to_string(token_len_) + ", key " +
                            std::to_string(key_len_) + ", value " + std::to_string(value_len_) +
                            " bytes, wait " + std::to_string(request_.timeout_ms) + " ms)";
  bool fits = token_len_ <= kStoreMaxTokenBytes && key_len_ <= kStoreMaxKeyBytes;
  switch (request_.op) {
    case StoreOp::kSet:
      fits = fits && value_len_ <= kStoreMaxValueBytes && request_.timeout_ms == 0;
      break;
    case StoreOp::kGet:
      fits = fits && value_len_ == 0 && request_.timeout_ms <= kStoreMaxWaitMs;
      break;
    case StoreOp::kAdd:
      fits = fits && value_len_ == 8 && request_.timeout_ms == 0;
      break;
    default:
      return invalid_argument(kPeer + ": unknown store operation " + std::to_string(int(h[5])));
  }
  if (!reserved_zero) return invalid_argument(kPeer + ": reserved header fields are not zero");
  if (!fits)
    return invalid_argument(kPeer + ": request beyond the limits of its operation " + sizes);
  presented_.clear();
  presented_.reserve(token_len_);
  return ok_status();
}

Status RequestReader::check_token() {
  if (!same_token(presented_, token_)) {
    return permission_denied(
        "wrong job token: this process does not belong to the job (check WEIGHTLIFT_JOB_TOKEN)");
  }
  authenticated_ = true;
  request_.token = presented_;
  return ok_status();
}

Result<std::optional<StoreRequest>> RequestReader::consume(std::span<const std::byte> bytes) {
  if (spent_) return failed_precondition(kPeer + ": the stream already failed");
  WL_CHECK_LE(bytes.size(), wanted()) << "a caller read past the current part";
  auto fail = [&](Status s) -> Result<std::optional<StoreRequest>> {
    spent_ = true;
    return s;
  };
  const auto* chars = reinterpret_cast<const char*>(bytes.data());
  switch (part_) {
    case Part::kHeader:
      std::memcpy(header_ + got_, bytes.data(), bytes.size());
      break;
    case Part::kToken:
      presented_.append(chars, bytes.size());
      break;
    case Part::kKey:
      request_.key.append(chars, bytes.size());
      break;
    case Part::kValue:
      request_.value.insert(request_.value.end(), bytes.begin(), bytes.end());
      break;
  }
  got_ += bytes.size();
  // Move on through every part that is complete (an empty token, key or value completes at once).
  while (wanted() == 0) {
    got_ = 0;
    switch (part_) {
      case Part::kHeader:
        if (Status s = start_request(); !s.ok()) return fail(s);
        part_ = Part::kToken;
        break;
      case Part::kToken:
        if (Status s = check_token(); !s.ok()) return fail(s);
        part_ = Part::kKey;
        break;
      case Part::kKey:
        part_ = Part::kValue;
        break;
      case Part::kValue:
        part_ = Part::kHeader;
        return std::optional<StoreRequest>(std::move(request_));
    }
  }
  return std::optional<StoreRequest>();
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
  // In pieces: what a reply declares is only reserved as it arrives.
  while (r.payload.size() < len) {
    const size_t at = r.payload.size();
    r.payload.resize(at + std::min<uint64_t>(len - at, uint64_t(1) << 20));
    WL_RETURN_IF_ERROR(
        read_exact(fd, r.payload.data() + at, r.payload.size() - at, deadline, what));
  }
  if (r.format_version != kStoreWireFormatVersion)
    return format_version_mismatch(r.format_version, what);
  return r;
}

}  // namespace wl::comm::detail
