#include "weightlift/core/status.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace wl {

namespace detail {
void value_of_error(const Status& status) {
  std::fprintf(stderr, "Result::value() on an error: %s\n", status.to_string().c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kOutOfRange:
      return "OutOfRange";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kDeadlineExceeded:
      return "DeadlineExceeded";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code_)) + ": " + printable(message_);
}

namespace {

// Length of the well-formed UTF-8 sequence at text[i] (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), or 0.
size_t utf8_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = byte(i);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
  if (b >= 0xc2 && b <= 0xdf) {
    n = 2;
  } else if (b >= 0xe0 && b <= 0xef) {
    n = 3;
    if (b == 0xe0) lo = 0xa0;
    if (b == 0xed) hi = 0x9f;
  } else if (b >= 0xf0 && b <= 0xf4) {
    n = 4;
    if (b == 0xf0) lo = 0x90;
    if (b == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (i + n > text.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (byte(i + k) < 0x80 || byte(i + k) > 0xbf) return 0;
  return n;
}

}  // namespace

std::string printable(std::string_view text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) {
        escape(c);
      } else {
        out += char(c);
      }
      ++i;
      continue;
    }
    const size_t n = utf8_length(text, i);
    // U+0080..U+009F (C2 80..C2 9F) are the C1 controls: CSI among them.
    if (n == 0 || (n == 2 && c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0)) {
      for (size_t k = 0; k < std::max<size_t>(n, 1); ++k)
        escape(static_cast<unsigned char>(text[i + k]));
      i += std::max<size_t>(n, 1);
      continue;
    }
    out.append(text.substr(i, n));
    i += n;
  }
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, std::string(context) + ": " + message_);
}

Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
Status failed_precondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
Status deadline_exceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
Status aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
Status permission_denied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

Status errno_status(std::string_view what, int err) {
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      code = StatusCode::kNotFound;
      break;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
      code = StatusCode::kResourceExhausted;
      break;
    case EACCES:
    case EPERM:
    case EROFS:
      code = StatusCode::kPermissionDenied;
      break;
    case EINVAL:
    case EISDIR:
    case ENAMETOOLONG:
      code = StatusCode::kInvalidArgument;
      break;
    case ETIMEDOUT:
      code = StatusCode::kDeadlineExceeded;
      break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
      code = StatusCode::kUnavailable;
      break;
    case EIO:
      code = StatusCode::kDataLoss;
      break;
    default:
      break;
  }
  return Status(code, std::string(what) + ": " + std::strerror(err));
}

}  // namespace wl
