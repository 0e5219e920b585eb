// Verifiable tasks, generated here: every problem is drawn from a seeded generator, its answer
// is computed, and a completion is scored by rules (no model judges it).
//
//   add      "347+58=" -> "405"       multi-digit addition: digits carry from column to column,
//                                     so the answer needs several steps of work
//   sort     "sort 5192=" -> "1259"   the digits in ascending order
//   reverse  "rev cable=" -> "elbac"  a word's letters backwards
//
// Difficulty is a number: the most digits of an operand (add), the most digits (sort), the
// longest word (reverse); problems of every size from 1 up to it are drawn. Prompts and
// completions are bytes (train/tokenizer.h); a completion ends with the end-of-sequence token.
//
// Train and held-out problems never meet: a problem belongs to the held-out split when a hash of
// its text falls in the lowest 1/8 of the range, and the training stream skips those. The
// held-out set is a fixed list drawn from its own seed.
//
// Or the problems of a JSONL dataset (dataset.h), split by the same rule, each scored by a
// built-in verifier against its `answer` (verifiers.h) or by a reward process the user writes
// (reward_process.h), which the scoring process starts at its first score().
//
// Reward: 1 for the exact answer followed by the end token; otherwise `format_reward` when the
// completion is well formed (only the answer's alphabet, then the end token), else 0. The
// default is 0: a format reward pays a wrong answer for ending, and completions cut at the
// length limit are the long ones, so the policy learns to end early and drops the digits it
// needs (sort-3 from 42% held-out to 2% in 100 steps with 0.1; to 73% in 400 without; see
// docs/BENCHMARKS.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/random.h"
#include "weightlift/core/status.h"
#include "weightlift/rl/verifiers.h"
#include "weightlift/train/codec.h"

namespace wl::rl {

enum class TaskKind : uint8_t { kAdd, kSort, kReverse };
std::string_view task_name(TaskKind k);  // "add", "sort", "reverse"
std::optional<TaskKind> task_from_name(std::string_view name);

struct TaskOptions {
  TaskKind kind = TaskKind::kAdd;
  int difficulty = 3;
  double format_reward = 0.0;
  // A JSONL dataset instead of the generated problems (kind and difficulty unused then).
  std::string dataset;
  Verifier verifier = Verifier::kExact;
  std::string reward_cmd;                           // a reward process instead of the verifier
  std::chrono::milliseconds reward_timeout{60000};  // a batch's deadline
  // The longest completion generated, in tokens; 0: the dataset's longest answer.
  int max_completion_tokens = 0;
  // A Hugging Face tokenizer.json: the dataset's text as its ids (codec.h); empty: bytes.
  std::string tokenizer;
};

struct Problem {
  std::string prompt;  // "347+58="
  std::string answer;  // "405"; a dataset row's, or empty
  std::string row;     // a dataset row's JSON; empty for a generated problem
  bool chat = false;   // the prompt is a chat template's rendering: its specials are in it
};

struct Completion {
  std::string_view text;
  bool ended = false;  // the end token was produced
};

struct Score {
  double reward = 0;
  bool correct = false;
};

class PromptDataset;
class RewardProcess;

class Task {
 public:
  // InvalidArgument for a difficulty out of [1, 9] (names the field); a dataset's errors
  // (dataset.h), or rows without an answer for a verifier.
  static Result<Task> create(const TaskOptions& options);
  ~Task();
  Task(Task&&) noexcept;
  Task& operator=(Task&&) noexcept;

  const TaskOptions& options() const { return options_; }
  // The next training problem from `rng` (never one of the held-out split).
  Problem sample(Rng& rng) const;
  // The fixed held-out problems: `count` of them, the same for a given seed and difficulty.
  std::vector<Problem> held_out(int count, uint64_t seed) const;
  // The score of `completion` (the generated text, end token stripped by the caller:
  // `ended` says whether it was produced) for `problem`.
  double reward(const Problem& problem, std::string_view completion, bool ended) const;
  bool correct(const Problem& problem, std::string_view completion, bool ended) const;
  // The rewards of a problem's completions, by whichever rule the task has; a reward
  // process's failure is the error (reward_process.h).
  Result<std::vector<Score>> score(const Problem& problem, std::span<const Completion> completions);
  // Seconds the reward process has taken, all batches (0 without one).
  double reward_seconds() const;
  bool has_answers() const;  // every problem has one (SFT needs them)
  // Longest prompt and answer any problem of this difficulty has, in bytes.
  int max_prompt_bytes() const;
  int max_answer_bytes() const;
  // The text's tokens: the vocabulary, and the longest prompt (its special tokens included)
  // and answer (without the end token) any problem has in it.
  const train::Codec& codec() const { return codec_; }
  // A problem's prompt as ids: with the vocabulary's special tokens, or, rendered by a chat
  // template (which wrote them), without more.
  std::vector<int64_t> prompt_ids(const Problem& p) const {
    return p.chat ? codec_.encode_answer(p.prompt) : codec_.encode_prompt(p.prompt);
  }
  int64_t max_prompt_tokens() const { return max_prompt_tokens_; }
  int64_t max_answer_tokens() const { return max_answer_tokens_; }

  static bool in_held_out_split(std::string_view prompt);

 private:
  explicit Task(TaskOptions o);
  Problem draw(Rng& rng) const;
  bool answer_alphabet(char c) const;
  TaskOptions options_;
  std::shared_ptr<const PromptDataset> dataset_;
  train::Codec codec_ = train::Codec::bytes();
  int64_t max_prompt_tokens_ = 0, max_answer_tokens_ = 0;
  std::unique_ptr<RewardProcess> reward_process_;
};

}  // namespace wl::rl
