#include "weightlift/core/status.h"

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
  return std::string(status_code_name(code_)) + ": " + message_;
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
