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

TEST(Status, PrintableEscapesControlsAndBrokenUtf8) {
  EXPECT_EQ(printable("plain text, caf\xc3\xa9, \xe2\x82\xac"),
            "plain text, caf\xc3\xa9, \xe2\x82\xac");
  EXPECT_EQ(printable("a\nb\r\x1b[31m\x7f"), "a\\x0ab\\x0d\\x1b[31m\\x7f");
  EXPECT_EQ(printable(std::string_view("nul\0", 4)), "nul\\x00");
  // C1 controls (U+009B is CSI), a stray continuation byte, an overlong '/', a surrogate, a
  // sequence cut short at the end.
  EXPECT_EQ(printable("\xc2\x9b"), "\\xc2\\x9b");
  EXPECT_EQ(printable("\x80"), "\\x80");
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(printable("\xe2\x82"), "\\xe2\\x82");
  EXPECT_EQ(invalid_argument("key 'a\nb'").to_string(), "InvalidArgument: key 'a\\x0ab'");
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
