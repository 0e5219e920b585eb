#include "validate.h"

#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "commands.h"
#include "flag_terms.h"

namespace wl::app {

int exit_code_of(const Status& s) {
  if (s.ok()) return 0;
  return s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
}

int report(const char* command, const Status& s) {
  if (s.ok()) return 0;
  std::fprintf(stderr, "weightlift %s: %s\n", command, in_flag_terms(s.to_string()).c_str());
  return exit_code_of(s);
}

namespace {

// What a user typed, quoted, shortened: a flag's value can be anything, including a
// 5,000-digit number, and the message must stay one readable line.
std::string quoted(std::string_view text) {
  if (text.size() > 40) return "'" + std::string(text.substr(0, 37)) + "...'";
  return "'" + std::string(text) + "'";
}

// The "expected ..." half of every message, shared by the Status and the CLI11 forms.
std::string expected_real(Interval allowed) {
  return "expected a finite number in " + allowed.to_string();
}
std::string expected_count(int64_t lo, int64_t hi) {
  return "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}
std::string expected_bytes(uint64_t lo, uint64_t hi) {
  return "expected a byte size in [" + bytes_to_string(lo) + ", " + bytes_to_string(hi) +
         "] (digits with an optional K, M, G, T suffix, powers of 1024)";
}

Status bad(std::string_view flag, std::string_view text, const std::string& expected) {
  return invalid_argument(std::string(flag) + " " + quoted(text) + ": " + expected);
}

// Strict decimal integer: an optional '-', digits, nothing else, within int64.
bool read_int(std::string_view text, int64_t* out) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out, 10);
  return ec == std::errc() && p == end;
}

// CLI11's side: run `parse` on the flag's text, replace the text by `canonical` of the value.
template <class Parse, class Canonical>
CLI::Validator transform(std::string description, Parse parse, Canonical canonical) {
  return CLI::Validator(
      [parse, canonical](std::string& text) -> std::string {
        auto v = parse(text);
        if (!v.ok()) {
          // parse names the flag as "", so its message starts with a space: drop it.
          std::string m = v.status().message();
          return m.substr(m.find_first_not_of(' '));
        }
        text = canonical(*v);
        return {};
      },
      std::move(description));
}

}  // namespace

std::string show_number(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::trunc(v) && std::fabs(v) < 1e15) return std::to_string(int64_t(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // The shortest of %g's forms that reads back the same, so bounds print as 0.9, not 0.9000...
  for (int digits = 1; digits <= 17; ++digits) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", digits, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

bool Interval::contains(double v) const {
  if (!std::isfinite(v)) return false;
  const bool above = lo_open ? v > lo : v >= lo;
  const bool below = hi_open ? v < hi : v <= hi;
  return above && below;
}

std::string Interval::to_string() const {
  return std::string(lo_open ? "(" : "[") + show_number(lo) + ", " + show_number(hi) +
         (hi_open ? ")" : "]");
}

std::string bytes_to_string(uint64_t bytes) {
  static const char* kUnits[] = {"T", "G", "M", "K"};
  for (int i = 0; i < 4; ++i) {
    const int shift = 40 - 10 * i;
    if (bytes != 0 && bytes % (uint64_t(1) << shift) == 0)
      return std::to_string(bytes >> shift) + kUnits[i];
  }
  return std::to_string(bytes);
}

Status check_real(std::string_view flag, double value, Interval allowed) {
  if (allowed.contains(value)) return ok_status();
  return bad(flag, show_number(value), expected_real(allowed));
}

Status check_count(std::string_view flag, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return ok_status();
  return bad(flag, std::to_string(value), expected_count(lo, hi));
}

Result<double> parse_real(std::string_view flag, std::string_view text, Interval allowed) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v, std::chars_format::general);
  if (ec != std::errc() || p != end || !allowed.contains(v))
    return bad(flag, text, expected_real(allowed));
  // Most of what these flags set is held as a float: 1e-300 is in (0, 1] but its float is 0,
  // and 0.9999999999 is in [0, 1) but its float is 1.
  if (!allowed.contains(double(float(v)))) {
    return bad(flag, text,
               expected_real(allowed) + " in single precision (it rounds to " +
                   show_number(double(float(v))) + ")");
  }
  return v;
}

Result<int64_t> parse_count(std::string_view flag, std::string_view text, int64_t lo, int64_t hi) {
  int64_t v = 0;
  if (!read_int(text, &v) || v < lo || v > hi) return bad(flag, text, expected_count(lo, hi));
  return v;
}

Result<uint64_t> parse_u64(std::string_view flag, std::string_view text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v, 10);
  if (ec != std::errc() || p != end) return bad(flag, text, "expected an integer in [0, 2^64 - 1]");
  return v;
}

Result<uint64_t> parse_bytes(std::string_view flag, std::string_view text, uint64_t lo,
                             uint64_t hi) {
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + digits, v, 10);
  std::string_view unit = text.substr(digits);
  int shift = 0;
  if (!unit.empty()) {
    const std::string_view kPrefixes = "KMGT";
    const size_t at = kPrefixes.find(char(std::toupper(static_cast<unsigned char>(unit[0]))));
    if (at != std::string_view::npos) {
      shift = 10 * int(at + 1);
      unit.remove_prefix(1);
    }
  }
  const bool unit_ok = unit.empty() || unit == "B" || unit == "b" || (shift > 0 && unit == "iB");
  if (digits == 0 || ec != std::errc() || !unit_ok || (shift > 0 && (v >> (64 - shift)) != 0))
    return bad(flag, text, expected_bytes(lo, hi));
  v <<= shift;
  if (v < lo || v > hi) return bad(flag, text, expected_bytes(lo, hi));
  return v;
}

CLI::Validator real(Interval allowed) {
  return transform(
      "NUMBER in " + allowed.to_string(),
      [allowed](const std::string& t) { return parse_real("", t, allowed); },
      [](double v) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", v);  // reads back exactly
        return std::string(buf);
      });
}

CLI::Validator count(int64_t lo, int64_t hi) {
  return transform(
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
      [lo, hi](const std::string& t) { return parse_count("", t, lo, hi); },
      [](int64_t v) { return std::to_string(v); });
}

CLI::Validator u64() {
  return transform(
      "UINT64", [](const std::string& t) { return parse_u64("", t); },
      [](uint64_t v) { return std::to_string(v); });
}

CLI::Validator bytes(uint64_t lo, uint64_t hi) {
  return transform(
      "BYTES in [" + bytes_to_string(lo) + ", " + bytes_to_string(hi) + "]",
      [lo, hi](const std::string& t) { return parse_bytes("", t, lo, hi); },
      [](uint64_t v) { return std::to_string(v); });
}

CLI::Validator seconds() { return count(1, kMaxSeconds).description("SECONDS in [1, 86400]"); }

std::string default_corpus_dir() {
  const std::string here = "data/brown";
  std::error_code ec;
  if (std::filesystem::is_directory(here, ec)) return here;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return here;
  for (std::filesystem::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
       dir = dir.parent_path()) {
    if (std::filesystem::is_directory(dir / here, ec)) return (dir / here).string();
  }
  return here;
}

}  // namespace wl::app
