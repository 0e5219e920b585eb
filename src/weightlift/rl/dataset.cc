// dataset.h.
#include "weightlift/rl/dataset.h"

#include <nlohmann/json.hpp>

#include "weightlift/core/file_io.h"
#include "weightlift/rl/tasks.h"
#include "weightlift/text/chat_template.h"
#include "weightlift/train/jsonl.h"

namespace wl::rl {
namespace {

using Json = nlohmann::json;

// A dataset a person writes fits in memory many times over; the cap keeps a wrong path
// (a model file, /dev/zero) from eating it.
constexpr uint64_t kMaxDatasetBytes = 1ull << 30;

Result<DatasetRow> parse_row(const Json& j, int64_t line, const std::string& where) {
  if (!j.is_object()) return invalid_argument(where + ": not a JSON object");
  DatasetRow row{.json = j.dump(), .line = line};
  if (j.contains("messages")) {
    if (j.contains("prompt")) return invalid_argument(where + ": both 'prompt' and 'messages'");
    row.messages = j["messages"].dump();
    WL_RETURN_IF_ERROR(text::ChatTemplate::messages_from_json(row.messages, where).status());
  } else if (!j.contains("prompt")) {
    return invalid_argument(where + ": no 'prompt' (or 'messages') field");
  } else {
    const Json& prompt = j["prompt"];
    if (!prompt.is_string() || prompt.get<std::string>().empty()) {
      return invalid_argument(where + ": 'prompt' is " + prompt.dump() +
                              ", expected a non-empty string");
    }
    row.prompt = prompt.get<std::string>();
  }
  if (j.contains("answer")) {
    const Json& a = j["answer"];
    if (a.is_string()) {
      row.answer = a.get<std::string>();
    } else if (a.is_number()) {
      row.answer = a.dump();
    } else {
      return invalid_argument(where + ": 'answer' is " + a.dump() +
                              ", expected a string or a number");
    }
  }
  return row;
}

}  // namespace

Status PromptDataset::render_chats(
    const std::function<Result<std::string>(const DatasetRow&)>& render) {
  for (auto* split : {&train_, &held_out_}) {
    for (DatasetRow& r : *split) {
      if (r.messages.empty()) continue;
      Result<std::string> prompt = render(r);
      if (!prompt.ok()) return prompt.status().with_context(path_ + ":" + std::to_string(r.line));
      r.prompt = *std::move(prompt);
      longest_prompt_ = std::max(longest_prompt_, r.prompt.size());
    }
  }
  return ok_status();
}

Result<PromptDataset> PromptDataset::load(const std::string& path) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, kMaxDatasetBytes, "a dataset"));
  PromptDataset d;
  d.path_ = path;
  WL_RETURN_IF_ERROR(train::for_each_json_line(path, text, [&](const train::JsonLine& l) -> Status {
    WL_ASSIGN_OR_RETURN(DatasetRow row, parse_row(l.value, l.number, l.at));
    d.longest_prompt_ = std::max(d.longest_prompt_, row.prompt.size());
    d.chats_ += !row.messages.empty();
    if (row.answer) {
      ++d.answers_;
      d.longest_answer_ = std::max(d.longest_answer_, row.answer->size());
    }
    const bool held = Task::in_held_out_split(row.messages.empty() ? row.prompt : row.messages);
    (held ? d.held_out_ : d.train_).push_back(std::move(row));
    return ok_status();
  }));
  if (d.train_.empty() && d.held_out_.empty()) return invalid_argument(path + ": no rows");
  if (d.train_.empty() || d.held_out_.empty()) {
    return invalid_argument(path + ": all " + std::to_string(d.train_.size() + d.held_out_.size()) +
                            " rows fall in the " + (d.train_.empty() ? "held-out" : "training") +
                            " split (a prompt is held out when its hash is in the lowest 1/8); "
                            "give more rows");
  }
  return d;
}

}  // namespace wl::rl
