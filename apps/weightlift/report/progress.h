// A progress bar for long work: done/total, rate, ETA and a caller-supplied status.
// On a terminal it redraws one line; otherwise (CI logs, pipes) it prints a plain line at
// most every `log_interval_s` seconds so logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace wl::app {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, std::string unit, double log_interval_s = 10);
  // `rate` is in the caller's unit per second (e.g. tokens/s); `status` is shown after it.
  void update(int64_t done, double rate, const std::string& rate_unit, const std::string& status);
  void finish();

 private:
  std::string label_, unit_;
  int64_t total_;
  bool tty_;
  double log_interval_s_;
  std::chrono::steady_clock::time_point start_, last_print_;
  bool printed_ = false;
};

// A stage name and its percentage on one redrawn line of a terminal's stderr, for work that
// knows its fraction done but not a count: shown once the work has taken two seconds, so quick
// runs print nothing; nothing at all when stderr is not a terminal.
class StageProgress {
 public:
  void update(const std::string& stage, double fraction);
  void clear();  // erases the line, if one was drawn
  ~StageProgress() { clear(); }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool shown_ = false;
};

}  // namespace wl::app
