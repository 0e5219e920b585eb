// units.h.
#include "report/units.h"

#include <cmath>
#include <cstdio>

namespace wl::app {
namespace {

// value / 1000^p with p the largest prefix (up to G) not above it, and that prefix's letter.
struct Scaled {
  double value;
  const char* prefix;
};

Scaled scale(double v) {
  if (v >= 1e9) return {v / 1e9, "G"};
  if (v >= 1e6) return {v / 1e6, "M"};
  if (v >= 1e3) return {v / 1e3, "k"};
  return {v, ""};
}

}  // namespace

std::string format_si(double value, int decimals) {
  const Scaled s = scale(value);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f%s", decimals, s.value, s.prefix);
  return buf;
}

std::string format_bytes(double bytes, int decimals) {
  const Scaled s = scale(bytes);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f %sB", *s.prefix ? decimals : 0, s.value, s.prefix);
  return buf;
}

std::string format_params(double count) {
  const Scaled s = scale(count);
  // Model sizes say B for billions ("a 6.9B model").
  const char* prefix = *s.prefix == 'G' ? "B" : s.prefix;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f%s", s.value, prefix);
  return buf;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t t = int64_t(seconds + 0.5);
  char buf[32];
  if (t >= 3600) {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(t / 3600), long(t % 3600 / 60));
  } else if (t >= 60) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", long(t / 60), long(t % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lds", long(t));
  }
  return buf;
}

std::string with_commas(int64_t n) {
  const std::string s = std::to_string(n < 0 ? -n : n);
  std::string out = n < 0 ? "-" : "";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return out;
}

}  // namespace wl::app
