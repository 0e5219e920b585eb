// dataset.h.
#include "weightlift/rl/dataset.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "weightlift/core/file_io.h"
#include "weightlift/rl/tasks.h"

namespace wl::rl {
namespace {

using Json = nlohmann::json;

// A dataset a person writes fits in memory many times over; the cap keeps a wrong path
// (a model file, /dev/zero) from eating it.
constexpr uint64_t kMaxDatasetBytes = 1ull << 30;

Result<DatasetRow> parse_row(const std::string& text, int64_t line, const std::string& where) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    return invalid_argument(where + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return invalid_argument(where + ": not a JSON object");
  if (j.contains("messages")) {
    return invalid_argument(where +
                            ": chat 'messages' need the checkpoint's chat template, which "
                            "weightlift does not render yet; give a 'prompt' string");
  }
  if (!j.contains("prompt")) return invalid_argument(where + ": no 'prompt' field");
  const Json& prompt = j["prompt"];
  if (!prompt.is_string() || prompt.get<std::string>().empty()) {
    return invalid_argument(where + ": 'prompt' is " + prompt.dump() +
                            ", expected a non-empty string");
  }
  DatasetRow row{.prompt = prompt.get<std::string>(), .json = j.dump(), .line = line};
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

Result<PromptDataset> PromptDataset::load(const std::string& path) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, kMaxDatasetBytes, "a dataset"));
  PromptDataset d;
  d.path_ = path;
  std::istringstream in(text);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    WL_ASSIGN_OR_RETURN(DatasetRow row, parse_row(line, n, path + ":" + std::to_string(n)));
    d.longest_prompt_ = std::max(d.longest_prompt_, row.prompt.size());
    if (row.answer) {
      ++d.answers_;
      d.longest_answer_ = std::max(d.longest_answer_, row.answer->size());
    }
    (Task::in_held_out_split(row.prompt) ? d.held_out_ : d.train_).push_back(std::move(row));
  }
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
