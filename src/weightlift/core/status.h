// Status and Result<T>: how weightlift reports what the world does to it.
//
// A dead peer, a truncated file, a timeout or a bad flag is a Status that says what failed,
// where, and (through its code) whether retrying can help. Our own bugs are not Statuses:
// they are WL_CHECK failures (check.h) that print both values and abort. docs/errors.md has
// the rules and the meaning of every code.
#pragma once

#include <cstdint>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace wl {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller's input is wrong (bad flag, shape, preset); do not retry
  kNotFound,            // a file, tensor, key or checkpoint name does not exist
  kDataLoss,            // a file or message is corrupted or truncated
  kFailedPrecondition,  // the system is not in a state where this can run; fix state first
  kOutOfRange,          // an offset or index beyond the end of something
  kResourceExhausted,   // out of memory, disk full, watermark exceeded
  kDeadlineExceeded,    // a wait timed out; the peer may be slow or stopped
  kUnavailable,         // a peer is unreachable or died; retry after reconnecting may help
  kAborted,             // an operation was cut short (e.g. a collective after a peer died)
  kPermissionDenied,    // wrong job token, refused by a peer
  kInternal,            // a failure in a library we call (UCX, oneDNN) that we cannot classify
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "NotFound: config.json: no such file". OK prints as "OK". The message goes through
  // printable(): it often quotes what the world gave us (a file name, a key, a preset).
  std::string to_string() const;

  // Returns a copy whose message is "context: message"; for adding where a failure happened
  // as it propagates up ("loading checkpoint ckpt/step-100: ...").
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return Status(); }

// `text` safe to print on one line of a terminal: control characters (C0, DEL, C1) and bytes
// that are not UTF-8 become \xNN, so a name that holds a newline or an escape sequence can
// neither split an error into two lines nor repaint the user's terminal.
std::string printable(std::string_view text);

// Factories, one per code, so call sites read as what happened.
Status invalid_argument(std::string message);
Status not_found(std::string message);
Status data_loss(std::string message);
Status failed_precondition(std::string message);
Status out_of_range(std::string message);
Status resource_exhausted(std::string message);
Status deadline_exceeded(std::string message);
Status unavailable(std::string message);
Status aborted(std::string message);
Status permission_denied(std::string message);
Status internal_error(std::string message);

// Status from errno after a failed system call: "open data/brown/ca01: No such file or
// directory", with the code chosen from errno (ENOENT -> kNotFound, ENOSPC -> kResourceExhausted).
Status errno_status(std::string_view what, int err);

namespace detail {
// Reading the value of a Result that holds an error is our own bug: print the error, abort.
[[noreturn]] void value_of_error(const Status& status);
}  // namespace detail

// Either a T or a non-OK Status. value() (and * and ->) on an error aborts with its message.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "Result built from OK");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    if (!ok()) detail::value_of_error(std::get<Status>(v_));
    return std::get<T>(v_);
  }
  const T& value() const& {
    if (!ok()) detail::value_of_error(std::get<Status>(v_));
    return std::get<T>(v_);
  }
  T&& value() && {
    if (!ok()) detail::value_of_error(std::get<Status>(v_));
    return std::get<T>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace wl

#define WL_STATUS_CONCAT_INNER(a, b) a##b
#define WL_STATUS_CONCAT(a, b) WL_STATUS_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if `expr` is not OK.
#define WL_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::wl::Status wl_status_ = (expr);        \
    if (!wl_status_.ok()) return wl_status_; \
  } while (0)

// `WL_ASSIGN_OR_RETURN(auto x, f());` declares x from a Result or returns its Status.
#define WL_ASSIGN_OR_RETURN(lhs, expr) \
  WL_ASSIGN_OR_RETURN_IMPL(WL_STATUS_CONCAT(wl_result_, __LINE__), lhs, expr)
#define WL_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
