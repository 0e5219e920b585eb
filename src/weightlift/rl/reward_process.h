// A reward a user writes, as a process: `--reward-cmd "python3 my_reward.py"` is started once
// (through /bin/sh) by the process that scores samples, and speaks JSON lines:
//
//   in:   {"prompt": "...", "completion": "...", "ended": true, "row": {...the dataset row...}}
//   out:  {"reward": 0.5}                  (a finite number; optionally "correct": true/false)
//
// one reply per query, in order. A batch's queries are all written before its replies are read
// (both directions drained together, so neither side blocks on a full pipe), and the whole
// batch has one deadline. A process that exits, closes its output, answers with something that
// is not such an object, answers NaN or infinity, or misses the deadline stops the run with
// an error naming the command, the sample (its index and prompt) and the tail of the process's
// stderr; nothing is trained on a batch that failed. The process is killed with its parent
// (PR_SET_PDEATHSIG) and when this object goes.
//
// python/weightlift/reward.py serves a Python function this way in one line.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::rl {

struct RewardQuery {
  std::string_view prompt, completion;
  bool ended = false;
  std::string_view row_json;  // the dataset row, compact JSON; empty: null
};

struct RewardReply {
  double reward = 0;
  std::optional<bool> correct;
};

class RewardProcess {
 public:
  // Starts `command`. The error names the command when it cannot be started; one that starts
  // and dies at once shows up at the first score().
  static Result<std::unique_ptr<RewardProcess>> start(const std::string& command,
                                                      std::chrono::milliseconds timeout);
  ~RewardProcess();
  RewardProcess(const RewardProcess&) = delete;
  RewardProcess& operator=(const RewardProcess&) = delete;

  // One reply per query, in order.
  Result<std::vector<RewardReply>> score(std::span<const RewardQuery> queries);

  double seconds() const { return seconds_; }  // spent in score(), all batches
  const std::string& command() const { return command_; }

 private:
  RewardProcess(std::string command, std::chrono::milliseconds timeout, pid_t pid, int in_fd,
                int out_fd, int err_fd);
  // The error of a failed batch, kept for every later one; `ended`: the process closed its
  // end, so it is exiting (its status is waited for, briefly).
  Status fail(const std::string& what, std::span<const RewardQuery> queries, size_t sample,
              bool ended = false);
  void drain_stderr();

  std::string command_;
  std::chrono::milliseconds timeout_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int in_fd_ = -1, out_fd_ = -1, err_fd_ = -1;  // its stdin (ours to write), stdout, stderr
  std::string pending_;                         // stdout read past the last full line
  std::string stderr_tail_;
  std::optional<Status> broken_;  // a failure is final: the process's state is unknown after it
  double seconds_ = 0;
};

}  // namespace wl::rl
