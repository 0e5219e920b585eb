#include "weightlift/core/status.h"

#include <gtest/gtest.h>

#include <cerrno>

#include "weightlift/core/check.h"

namespace wl {
namespace {

Result<int> parse_positive(int x) {
  if (x <= 0) return invalid_argument("x must be positive, got " + std::to_string(x));
  return x;
}

Result<int> twice(int x) {
  WL_ASSIGN_OR_RETURN(int v, parse_positive(x));
  return 2 * v;
}

Status check_both(int a, int b) {
  WL_RETURN_IF_ERROR(parse_positive(a).status());
  WL_RETURN_IF_ERROR(parse_positive(b).status().with_context("second"));
  return ok_status();
}

TEST(Status, ResultCarriesValueOrError) {
  EXPECT_EQ(*twice(4), 8);
  Result<int> r = twice(-1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().to_string(), "InvalidArgument: x must be positive, got -1");
}

TEST(Status, ContextIsPrefixed) {
  Status s = check_both(1, 0);
  EXPECT_EQ(s.message(), "second: x must be positive, got 0");
  EXPECT_TRUE(check_both(1, 1).ok());
}

TEST(Status, ErrnoMapsToCodes) {
  EXPECT_EQ(errno_status("open x", ENOENT).code(), StatusCode::kNotFound);
  EXPECT_EQ(errno_status("write x", ENOSPC).code(), StatusCode::kResourceExhausted);
  EXPECT_NE(errno_status("open x", ENOENT).message().find("open x"), std::string::npos);
}

TEST(StatusDeath, CheckPrintsBothValues) {
  int a = 3, b = 4;
  EXPECT_DEATH({ WL_CHECK_EQ(a, b) << "extra"; }, "a == b \\(3 vs 4\\) extra");
}

// Reading the value of an error is a bug of ours: it aborts saying what the error was, rather
// than throwing bad_variant_access with no word of it.
TEST(StatusDeath, ValueOfAnErrorPrintsTheError) {
  Result<int> r = not_found("checkpoint 'step-9'");
  EXPECT_DEATH({ (void)r.value(); },
               "Result::value\\(\\) on an error: NotFound: checkpoint 'step-9'");
  EXPECT_DEATH({ (void)*std::move(r); }, "NotFound: checkpoint 'step-9'");
}

}  // namespace
}  // namespace wl
