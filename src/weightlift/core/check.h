// Checks for our own bugs: a failed check prints the condition, both values and where, then
// aborts. Never use them for input from the world (files, peers, flags): that is a Status.
#pragma once

#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>

namespace wl::detail {

[[noreturn]] void check_failed(const char* file, int line, const std::string& what);

// Collects `<<` context after a failed check, then aborts in its destructor.
class CheckMessage {
 public:
  CheckMessage(const char* file, int line, std::string what) : file_(file), line_(line) {
    os_ << what;
  }
  [[noreturn]] ~CheckMessage() { check_failed(file_, line_, os_.str()); }
  template <typename T>
  CheckMessage& operator<<(const T& v) {
    os_ << v;
    return *this;
  }

 private:
  const char* file_;
  int line_;
  std::ostringstream os_;
};

template <typename A, typename B>
std::string check_op_message(const char* expr, const A& a, const B& b) {
  std::ostringstream os;
  os << "check failed: " << expr << " (" << a << " vs " << b << ") ";
  return os.str();
}

}  // namespace wl::detail

#define WL_CHECK(cond) \
  if (cond) {          \
  } else               \
    ::wl::detail::CheckMessage(__FILE__, __LINE__, "check failed: " #cond " ")

#define WL_CHECK_OP(op, a, b)                                                                      \
  if (auto wl_ab_ = ::std::make_tuple((a), (b)); ::std::get<0>(wl_ab_) op ::std::get<1>(wl_ab_)) { \
  } else                                                                                           \
    ::wl::detail::CheckMessage(                                                                    \
        __FILE__, __LINE__,                                                                        \
        ::wl::detail::check_op_message(#a " " #op " " #b, ::std::get<0>(wl_ab_),                   \
                                       ::std::get<1>(wl_ab_)))

#define WL_CHECK_EQ(a, b) WL_CHECK_OP(==, a, b)
#define WL_CHECK_NE(a, b) WL_CHECK_OP(!=, a, b)
#define WL_CHECK_LT(a, b) WL_CHECK_OP(<, a, b)
#define WL_CHECK_LE(a, b) WL_CHECK_OP(<=, a, b)
#define WL_CHECK_GT(a, b) WL_CHECK_OP(>, a, b)
#define WL_CHECK_GE(a, b) WL_CHECK_OP(>=, a, b)
