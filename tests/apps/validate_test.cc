// The command-line edge's parsers (apps/weightlift/validate.h): strict decimal, ranges that
// print as a reader writes them, byte sizes whose units cannot overflow, and CLI11 handing
// our canonical value to the option.
#include "validate.h"

#include <gtest/gtest.h>

#include "commands.h"
#include "flag_terms.h"

namespace wl::app {
namespace {

// A library's error names option fields in backquotes; the command line's user reads them as
// the flags they typed, and anything quoted that is no flag stays as it was.
TEST(FlagTerms, FieldsAreWrittenAsTheFlagsOfTheCommand) {
  CLI::App app;
  CLI::App* rl = app.add_subcommand("rl");
  int tp = 1;
  std::string mode, dtype;
  rl->add_option("--rollout-tp", tp);
  rl->add_option("--trainer-dp-mode", mode);
  rl->add_option("--sync-dtype", dtype);
  learn_flags(app);
  EXPECT_EQ(in_flag_terms("`trainer_dp_mode` fsdp: use ddp; `rollout_tp` 3 with `sync_format` "
                          "fp8"),
            "--trainer-dp-mode fsdp: use ddp; --rollout-tp 3 with --sync-dtype fp8");
  EXPECT_EQ(in_flag_terms("`no_such_field` 2, `x`, a ` alone"),
            "`no_such_field` 2, `x`, a ` alone");
  EXPECT_EQ(in_flag_terms(""), "");
}

TEST(ExitCodes, WhatWasGivenWrongIsTwoAndEveryOtherFailureOne) {
  EXPECT_EQ(exit_code_of(ok_status()), 0);
  EXPECT_EQ(exit_code_of(invalid_argument("x")), kExitUsage);
  EXPECT_EQ(exit_code_of(data_loss("x")), kExitFailure);
  EXPECT_EQ(exit_code_of(unavailable("x")), kExitFailure);
  EXPECT_NE(kExitUsage, kExitFailure);
}

TEST(Validate, IntervalsPrintAsWritten) {
  EXPECT_EQ(kPositive.to_string(), "(0, inf)");
  EXPECT_EQ(kProbability.to_string(), "(0, 1]");
  EXPECT_EQ(kBeta.to_string(), "[0, 1)");
  EXPECT_EQ((Interval{.lo = 0.5, .hi = 1e6}).to_string(), "[0.5, 1000000]");
  EXPECT_TRUE(kProbability.contains(1));
  EXPECT_FALSE(kProbability.contains(0));
  EXPECT_FALSE(kPositive.contains(INFINITY));
  EXPECT_FALSE(kNonNegative.contains(NAN));
}

TEST(Validate, RealsAreFiniteDecimalsInRange) {
  EXPECT_EQ(*parse_real("--lr", "3e-3", kPositive), 3e-3);
  EXPECT_EQ(*parse_real("--beta2", "0.95", kBeta), 0.95);
  for (const char* bad : {"nan", "inf", "-inf", "0", "-1", "1e999", "", "1.0x", "0x1p3", " 1"}) {
    Result<double> r = parse_real("--lr", bad, kPositive);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().message(),
              "--lr '" + std::string(bad) + "': expected a finite number in (0, inf)");
  }
  EXPECT_TRUE(check_real("--lr", 1e-3, kPositive).ok());
  EXPECT_EQ(check_real("--beta1", 1, kBeta).message(),
            "--beta1 '1': expected a finite number in [0, 1)");
}

TEST(Validate, CountsAreStrictDecimalsInRange) {
  EXPECT_EQ(*parse_count("--steps", "010", 1, 100), 10);  // decimal, not octal
  EXPECT_EQ(*parse_count("--seq", "0", 0, 10), 0);
  for (const char* bad : {"0x10", "1e3", "", "-", "5.0", "99999999999999999999999", "+5"}) {
    EXPECT_FALSE(parse_count("--steps", bad, 1, 1000000000).ok()) << bad;
  }
  EXPECT_EQ(parse_count("--steps", "0", 1, 1000000000).status().message(),
            "--steps '0': expected an integer in [1, 1000000000]");
  // A long value is shortened in the message, which stays one readable line.
  const std::string digits(5000, '9');
  EXPECT_LT(parse_count("--steps", digits, 1, 10).status().message().size(), 120u);
  EXPECT_EQ(*parse_u64("--seed", "18446744073709551615"), UINT64_MAX);
  EXPECT_FALSE(parse_u64("--seed", "-1").ok());
  EXPECT_FALSE(parse_u64("--seed", "18446744073709551616").ok());
}

TEST(Validate, ByteSizesWithUnitsNeverOverflow) {
  EXPECT_EQ(*parse_bytes("--b", "4096", 1, kTiB), 4096u);
  EXPECT_EQ(*parse_bytes("--b", "64K", 1, kTiB), 64u << 10);
  EXPECT_EQ(*parse_bytes("--b", "256MiB", 1, kTiB), 256u << 20);
  EXPECT_EQ(*parse_bytes("--b", "1g", 1, kTiB), kGiB);
  EXPECT_EQ(*parse_bytes("--b", "1T", 1, kTiB), kTiB);
  EXPECT_EQ(*parse_bytes("--b", "8B", 1, kTiB), 8u);
  for (const char* bad : {"", "K", "-1", "12X", "1.5G", "2T", "99999999999G", "16777216T",
                          "18446744073709551616", "4iB", "1KK", "0"}) {
    EXPECT_FALSE(parse_bytes("--b", bad, 1, kTiB).ok()) << bad;
  }
  EXPECT_EQ(bytes_to_string(3 * kGiB), "3G");
  EXPECT_EQ(bytes_to_string(1000), "1000");
}

TEST(Validate, CliHandsTheCanonicalValueToTheOption) {
  CLI::App app;
  int64_t steps = 0;
  size_t size = 0;
  double lr = 0;
  app.add_option("--steps", steps)->transform(count(1, 100));
  app.add_option("--size", size)->transform(bytes(1, kTiB));
  app.add_option("--lr", lr)->transform(real(kPositive));
  app.parse(std::vector<std::string>{"0.25", "--lr", "64K", "--size", "010", "--steps"});
  EXPECT_EQ(steps, 10);
  EXPECT_EQ(size, 64u << 10);
  EXPECT_EQ(lr, 0.25);
  try {
    app.parse(std::vector<std::string>{"nan", "--lr"});
    FAIL() << "--lr nan was accepted";
  } catch (const CLI::ValidationError& e) {
    EXPECT_STREQ(e.what(), "--lr: 'nan': expected a finite number in (0, inf)");
  }
}

}  // namespace
}  // namespace wl::app
