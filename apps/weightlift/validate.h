// Where flags are checked. Every number a user types is parsed strictly (decimal, no
// overflow, no NaN or infinity where a finite value is meant) and checked against its allowed
// range when the command line is parsed, before any work starts: a bad flag is one line that
// names the flag, the range and what was given, never an internal check, a crash or a run that
// goes ahead with a value that makes no sense (`--lr nan` trains nothing, `--lr -1` the wrong
// way). Internal checks (WL_CHECK) stay for our own bugs; nothing typed may reach one.
//
//   cmd->add_option("--lr", o.lr)->transform(real({.lo = 0, .lo_open = true}));
//   cmd->add_option("--steps", o.steps)->transform(count(1, kMaxSteps));
//   cmd->add_option("--bucket-bytes", o.bucket_bytes)->transform(bytes(1, kTiB));
//
// The validators are CLI11 transforms: they also hand CLI11 the number in canonical decimal,
// so that "010" is ten (CLI11 alone reads it as octal eight) and "64M" reaches a byte count.
// The same checks return a Status for values that do not come through CLI11 (the Python API).
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "weightlift/core/status.h"

namespace wl::app {

// An interval of reals, written as a reader writes one: "(0, 1]", "[0, inf)".
struct Interval {
  double lo = -INFINITY;
  double hi = INFINITY;
  bool lo_open = false;
  bool hi_open = false;
  bool contains(double v) const;
  std::string to_string() const;
};

inline constexpr Interval kPositive{.lo = 0, .lo_open = true, .hi_open = true};  // (0, inf)
inline constexpr Interval kNonNegative{.lo = 0, .hi_open = true};                // [0, inf)
inline constexpr Interval kProbability{.lo = 0, .hi = 1, .lo_open = true};       // (0, 1]
inline constexpr Interval kBeta{.lo = 0, .hi = 1, .hi_open = true};              // [0, 1)

inline constexpr uint64_t kKiB = uint64_t(1) << 10;
inline constexpr uint64_t kGiB = uint64_t(1) << 30;
inline constexpr uint64_t kTiB = uint64_t(1) << 40;

// Upper bounds shared by several commands. Counts of things a single host holds are bounded by
// what one host can run; schedule lengths by what anyone would wait for.
inline constexpr int64_t kMaxThreads = 1024;      // the compute pool's own cap
inline constexpr int64_t kMaxSteps = 1000000000;  // updates, intervals between them
inline constexpr int64_t kMaxRows = 1 << 20;      // batch rows, sequence length, windows
inline constexpr int64_t kMaxRanks = 1024;        // processes of one job on one host
inline constexpr int64_t kMaxSeconds = 86400;     // timeouts: a day
// GPUs of a job that is planned or simulated, not run: ten times the largest clusters.
inline constexpr int64_t kMaxSimulatedGpus = 1 << 20;

// Status checks: InvalidArgument "<flag> <value>: expected ...".
Status check_real(std::string_view flag, double value, Interval allowed);
Status check_count(std::string_view flag, int64_t value, int64_t lo, int64_t hi);

// Strict parsers of what a user typed for `flag`.
Result<double> parse_real(std::string_view flag, std::string_view text, Interval allowed);
Result<int64_t> parse_count(std::string_view flag, std::string_view text, int64_t lo, int64_t hi);
Result<uint64_t> parse_u64(std::string_view flag, std::string_view text);
// Digits with an optional K, M, G or T (powers of 1024) and an optional B or iB: "64K",
// "256MiB", "1G", "4096".
Result<uint64_t> parse_bytes(std::string_view flag, std::string_view text, uint64_t lo,
                             uint64_t hi);

// The same as CLI11 transforms (the flag's name comes from CLI11 in front of the message).
CLI::Validator real(Interval allowed);
CLI::Validator count(int64_t lo, int64_t hi);
CLI::Validator u64();
CLI::Validator bytes(uint64_t lo, uint64_t hi);
CLI::Validator seconds();  // a timeout: a whole number of seconds in [1, kMaxSeconds]

// The shortest decimal that reads back as v ("0.9", "1e-05", "inf"): how reals are printed.
std::string show_number(double v);

// The Brown corpus's default folder: data/brown where the command runs, or else the checkout's
// that this binary was built in (build/<preset>/apps/weightlift sits three levels below it),
// so that the README's commands run from any directory.
std::string default_corpus_dir();

// "1K" for 1024, "3G" for 3 << 30, digits otherwise: how byte bounds are printed.
std::string bytes_to_string(uint64_t bytes);

}  // namespace wl::app
