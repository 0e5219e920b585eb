#include "report/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "report/units.h"

namespace wl::app {

ProgressBar::ProgressBar(std::string label, int64_t total, std::string unit, double interval)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      tty_(isatty(STDERR_FILENO)),
      log_interval_s_(interval),
      start_(std::chrono::steady_clock::now()),
      last_print_(start_) {}

void ProgressBar::update(int64_t done, double rate, const std::string& rate_unit,
                         const std::string& status) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double since = std::chrono::duration<double>(now - last_print_).count();
  const bool last = done >= total_;
  if (!tty_ && printed_ && since < log_interval_s_ && !last) return;
  if (tty_ && since < 0.1 && !last) return;
  last_print_ = now;
  printed_ = true;
  const double frac = total_ > 0 ? double(done) / double(total_) : 1.0;
  const double eta = done > 0 ? elapsed * (1.0 - frac) / frac : NAN;
  constexpr int kWidth = 24;
  std::string bar(size_t(kWidth), ' ');
  for (int i = 0; i < int(frac * kWidth); ++i) bar[size_t(i)] = '#';
  std::fprintf(stderr, "%s%s [%s] %ld/%ld %s  %s %s  %s  elapsed %s  ETA %s%s",
               tty_ ? "\r\033[K" : "", label_.c_str(), bar.c_str(), long(done), long(total_),
               unit_.c_str(), format_si(rate).c_str(), rate_unit.c_str(), status.c_str(),
               format_duration(elapsed).c_str(), format_duration(eta).c_str(), tty_ ? "" : "\n");
  std::fflush(stderr);
}

void StageProgress::update(const std::string& stage, double fraction) {
  const auto shown_after = std::chrono::seconds(2);
  if (!isatty(STDERR_FILENO) || std::chrono::steady_clock::now() - start_ < shown_after) return;
  std::fprintf(stderr, "\r%-40s %3d%%", stage.c_str(), int(fraction * 100));
  shown_ = true;
}

void StageProgress::clear() {
  if (shown_) std::fprintf(stderr, "\r%-45s\r", "");
  shown_ = false;
}

void ProgressBar::finish() {
  if (tty_ && printed_) std::fprintf(stderr, "\n");
}

}  // namespace wl::app
