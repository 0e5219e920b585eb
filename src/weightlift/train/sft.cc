// sft.h.
#include "weightlift/train/sft.h"

#include <nlohmann/json.hpp>

#include "weightlift/core/file_io.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/train/jsonl.h"

namespace wl::train {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxSftBytes = 4ull << 30;

struct Example {
  std::vector<int64_t> prompt, completion;  // the completion ends with the end token
};

Result<Example> parse_example(const Json& j, const std::string& at, const Codec& codec,
                              const text::ChatTemplate* chat) {
  if (!j.is_object()) return invalid_argument(at + ": not a JSON object");
  Example e;
  if (j.contains("messages")) {
    if (!chat) {
      return invalid_argument(at +
                              ": chat 'messages' need a tokenizer with a chat template "
                              "(`tokenizer`, or `model_dir`'s tokenizer.json)");
    }
    WL_ASSIGN_OR_RETURN(std::vector<text::ChatMessage> m,
                        text::ChatTemplate::messages_from_json(j["messages"].dump(), at));
    if (m.back().role != "assistant" || m.size() < 2) {
      return invalid_argument(at + ": a chat must end with the assistant's reply, after a turn");
    }
    const std::string reply = m.back().content;
    m.pop_back();
    Result<std::string> prompt = chat->render(m);
    if (!prompt.ok()) return prompt.status().with_context(at);
    e.prompt = codec.encode_answer(*prompt);  // the template wrote its special tokens
    e.completion = codec.encode_answer(reply);
  } else {
    if (!j.contains("prompt") || !j["prompt"].is_string() || !j.contains("completion") ||
        !j["completion"].is_string()) {
      return invalid_argument(at +
                              ": expected string \"prompt\" and \"completion\", or "
                              "\"messages\"");
    }
    e.prompt = codec.encode_prompt(j["prompt"].get<std::string>());
    e.completion = codec.encode_answer(j["completion"].get<std::string>());
  }
  e.completion.push_back(codec.eos());
  return e;
}

// Row `row` of `b` ([*, seq]) from example `e`: inputs, and the completion's targets.
void fill_row(const Example& e, int64_t seq, Batch& b, int64_t row) {
  std::vector<int64_t> all = e.prompt;
  all.insert(all.end(), e.completion.begin(), e.completion.end());
  const int64_t first_target = int64_t(e.prompt.size()) - 1;  // predicts the completion's first
  for (int64_t t = 0; t < seq; ++t) {
    const size_t at = size_t(row * seq + t);
    b.tokens[at] = t < int64_t(all.size()) ? all[size_t(t)] : all.back();  // padding: the end
    b.targets[at] = t >= first_target && t + 1 < int64_t(all.size()) ? all[size_t(t + 1)]
                                                                     : kernels::kIgnoreIndex;
  }
}

}  // namespace

Result<SftExamples> load_sft(const std::string& path, const Codec& codec,
                             const text::ChatTemplate* chat, int64_t seq) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, kMaxSftBytes, "an SFT file"));
  std::vector<Example> train, validation;
  WL_RETURN_IF_ERROR(for_each_json_line(path, text, [&](const JsonLine& l) -> Status {
    WL_ASSIGN_OR_RETURN(Example e, parse_example(l.value, l.at, codec, chat));
    const int64_t tokens = int64_t(e.prompt.size() + e.completion.size());
    if (e.prompt.empty() || tokens > seq + 1) {
      return invalid_argument(
          l.at + ": " + std::to_string(tokens) + " tokens" +
          (e.prompt.empty() ? " and an empty prompt"
                            : ", more than `seq` " + std::to_string(seq) + " + 1 (raise `seq`)"));
    }
    (in_held_out_split(l.text) ? validation : train).push_back(std::move(e));
    return ok_status();
  }));
  if (train.empty()) return invalid_argument(path + ": no training examples");
  SftExamples s;
  s.examples = int64_t(train.size() + validation.size());
  s.held_out = int64_t(validation.size());
  for (auto [examples, batch] : {std::pair{&train, &s.train}, {&validation, &s.validation}}) {
    const int64_t n = int64_t(examples->size());
    *batch = {n, seq, std::vector<int64_t>(size_t(n * seq)), std::vector<int64_t>(size_t(n * seq))};
    for (int64_t i = 0; i < n; ++i) fill_row((*examples)[size_t(i)], seq, *batch, i);
  }
  return s;
}

}  // namespace wl::train
