// RL prompts from a JSONL file a user writes, one problem per line:
//
//   {"prompt": "What is 12 + 30?", "answer": "42", "source": "mine"}
//
// `prompt` (a string), or `messages` (a chat: [{"role", "content"}, ...], rendered later by the
// checkpoint's chat template, text/chat_template.h) is required; `answer` (a string or a
// number) is what the built-in verifiers compare with; every other field is kept as written,
// for a reward process (reward_process.h), which receives the whole row. Blank lines are
// skipped; anything else that is not such an object is an error naming the file and the line,
// never a line dropped in silence.
//
// The split is Task's rule (tasks.h): a row is held out when a hash of its prompt (a chat's:
// of its messages' compact JSON) falls in the lowest 1/8, so a prompt is on the same side in every
// run and every file it appears in, and the training stream never draws a held-out row.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::rl {

struct DatasetRow {
  std::string prompt;                 // a chat's, once rendered (render_chats)
  std::string messages;               // a chat's messages, compact JSON; empty for a prompt row
  std::optional<std::string> answer;  // a number is kept as its JSON text ("42", "-0.5")
  std::string json;                   // the whole row, compact
  int64_t line = 0;                   // 1-based, in its file
};

class PromptDataset {
 public:
  // InvalidArgument naming `path` and the line for a line that is not a JSON object, lacks
  // `prompt`, has a prompt that is not a non-empty string, an answer that is neither a string
  // nor a number, or `messages`; NotFound for a missing file; InvalidArgument for a file with
  // no row, or none on one side of the split.
  static Result<PromptDataset> load(const std::string& path);
  // Every chat row's prompt, as `render` gives it (errors are prefixed by the file and line).
  Status render_chats(const std::function<Result<std::string>(const DatasetRow&)>& render);
  bool has_chats() const { return chats_ > 0; }

  const std::string& path() const { return path_; }
  const std::vector<DatasetRow>& train() const { return train_; }
  const std::vector<DatasetRow>& held_out() const { return held_out_; }
  bool every_row_has_an_answer() const { return answers_ == train_.size() + held_out_.size(); }
  size_t longest_prompt_bytes() const { return longest_prompt_; }
  size_t longest_answer_bytes() const { return longest_answer_; }

 private:
  std::string path_;
  std::vector<DatasetRow> train_, held_out_;
  size_t answers_ = 0, chats_ = 0, longest_prompt_ = 0, longest_answer_ = 0;
};

}  // namespace wl::rl
