// The one training run (run.h).
#include "weightlift/train/run.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>

namespace wl::train {

int64_t RunSchedule::last_step() const {
  return stop_after > 0 ? std::min(stop_after, steps) : steps;
}

bool RunSchedule::evaluates_at(int64_t step) const {
  return (eval_every > 0 && step % eval_every == 0) || step == steps;
}

bool RunSchedule::checkpoints_at(int64_t step) const {
  return checkpoint_every > 0 && step % checkpoint_every == 0;
}

std::string checkpoint_dir(const std::string& out_dir, int64_t step) {
  return out_dir + "/checkpoint-" + std::to_string(step);
}

Result<DirectoryLock> hold_out_dir(const std::string& out_dir, std::string_view field) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return errno_status("mkdir " + out_dir, ec.value());
  return DirectoryLock::acquire(out_dir, field);
}

Status RecordLog::open(const std::string& path, std::span<const std::string> lines) {
  if (out_.is_open()) out_.close();
  path_ = path;
  std::string text;
  for (const std::string& l : lines) text += l + "\n";
  WL_RETURN_IF_ERROR(write_file_atomically(path, text));
  out_.open(path, std::ios::app);
  if (!out_) return errno_status("open " + path, errno);
  return ok_status();
}

Status RecordLog::append(const std::string& line) {
  out_ << line << "\n";
  out_.flush();
  if (!out_) return errno_status("write " + path_, errno);
  return ok_status();
}

Result<std::vector<StepMetrics>> continue_metrics(RecordLog& log, const std::string& path,
                                                  int64_t keep_through) {
  std::vector<StepMetrics> kept;
  if (keep_through > 0) {
    WL_ASSIGN_OR_RETURN(kept, read_metrics(path));
    std::erase_if(kept, [&](const StepMetrics& m) { return m.step > keep_through; });
  }
  std::vector<std::string> lines;
  for (const StepMetrics& m : kept) lines.push_back(metrics_to_json(m));
  WL_RETURN_IF_ERROR(log.open(path, lines));
  return kept;
}

double Throughput::tokens_per_s() const {
  const double s = seconds();
  return s > 0 ? double(tokens_) / s : 0.0;
}

void Throughput::stamp(StepMetrics& m) const {
  m.elapsed_s = seconds();
  m.tokens_per_s = tokens_per_s();
}

}  // namespace wl::train
