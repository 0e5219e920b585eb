// tasks.h.
#include "weightlift/rl/tasks.h"

#include <algorithm>
#include <filesystem>
#include <unordered_set>

#include "weightlift/rl/dataset.h"
#include "weightlift/rl/reward_process.h"
#include "weightlift/text/chat_template.h"
#include "weightlift/train/jsonl.h"

namespace wl::rl {

std::string_view task_name(TaskKind k) {
  switch (k) {
    case TaskKind::kAdd:
      return "add";
    case TaskKind::kSort:
      return "sort";
    case TaskKind::kReverse:
      return "reverse";
  }
  return "?";
}

std::optional<TaskKind> task_from_name(std::string_view name) {
  for (TaskKind k : {TaskKind::kAdd, TaskKind::kSort, TaskKind::kReverse}) {
    if (task_name(k) == name) return k;
  }
  return std::nullopt;
}

namespace {

Problem problem_of(const DatasetRow& r) {
  return {r.prompt, r.answer.value_or(""), r.json, !r.messages.empty()};
}

// Every chat row of `d` rendered by the chat template of the tokenizer's tokenizer_config.json,
// with the generation prompt (thinking as the template's default).
Status render_chats(const TaskOptions& o, PromptDataset& d) {
  if (o.tokenizer.empty()) {
    return invalid_argument(d.path() +
                            ": chat 'messages' need a checkpoint's tokenizer and its chat "
                            "template (give `tokenizer`, a checkpoint's tokenizer.json beside its "
                            "tokenizer_config.json)");
  }
  const std::string config =
      (std::filesystem::path(o.tokenizer).parent_path() / "tokenizer_config.json").string();
  WL_ASSIGN_OR_RETURN(const text::ChatTemplate chat, text::ChatTemplate::from_config(config));
  return d.render_chats([&](const DatasetRow& r) -> Result<std::string> {
    WL_ASSIGN_OR_RETURN(const std::vector<text::ChatMessage> m,
                        text::ChatTemplate::messages_from_json(r.messages, "messages"));
    return chat.render(m);
  });
}

}  // namespace

Task::Task(TaskOptions o) : options_(std::move(o)) {}
Task::~Task() = default;
Task::Task(Task&&) noexcept = default;
Task& Task::operator=(Task&&) noexcept = default;

Result<Task> Task::create(const TaskOptions& o) {
  if (!o.dataset.empty()) {
    WL_ASSIGN_OR_RETURN(PromptDataset d, PromptDataset::load(o.dataset));
    if (o.reward_cmd.empty() && !d.every_row_has_an_answer()) {
      for (const auto* split : {&d.train(), &d.held_out()}) {
        for (const DatasetRow& r : *split) {
          if (!r.answer) {
            return invalid_argument(
                d.path() + ":" + std::to_string(r.line) + ": no 'answer' for the " +
                std::string(verifier_name(o.verifier)) + " verifier (or give a reward command)");
          }
        }
      }
    }
    if (o.max_completion_tokens < 0 ||
        (o.max_completion_tokens == 0 && d.longest_answer_bytes() == 0)) {
      return invalid_argument(d.path() +
                              ": no answer to size the completions by; set the longest "
                              "completion in tokens");
    }
    Task t(o);
    if (!o.tokenizer.empty()) {
      WL_ASSIGN_OR_RETURN(t.codec_, train::Codec::load(o.tokenizer));
    }
    if (d.has_chats()) WL_RETURN_IF_ERROR(render_chats(o, d));
    for (const auto* split : {&d.train(), &d.held_out()}) {
      for (const DatasetRow& r : *split) {
        t.max_prompt_tokens_ =
            std::max(t.max_prompt_tokens_, int64_t(t.prompt_ids(problem_of(r)).size()));
        if (r.answer && o.max_completion_tokens == 0) {
          t.max_answer_tokens_ =
              std::max(t.max_answer_tokens_, int64_t(t.codec_.encode_answer(*r.answer).size()));
        }
      }
    }
    if (o.max_completion_tokens > 0) t.max_answer_tokens_ = o.max_completion_tokens;
    t.dataset_ = std::make_shared<const PromptDataset>(std::move(d));
    return t;
  }
  if (!o.tokenizer.empty()) {
    return invalid_argument("`tokenizer` " + o.tokenizer + ": the generated " +
                            std::string(task_name(o.kind)) +
                            " problems speak weightlift's byte vocabulary; a tokenizer needs a "
                            "`dataset`");
  }
  if (o.difficulty < 1 || o.difficulty > 9) {
    return invalid_argument("`difficulty` " + std::to_string(o.difficulty) + ": expected 1 to 9");
  }
  if (!(o.format_reward >= 0 && o.format_reward < 1)) {
    return invalid_argument("`format_reward` " + std::to_string(o.format_reward) +
                            ": expected [0, 1)");
  }
  Task t(o);
  t.max_prompt_tokens_ = t.max_prompt_bytes() + 1;  // and the begin token
  t.max_answer_tokens_ = t.max_answer_bytes();
  return t;
}

namespace {

// A number of 1 to `digits` digits (the count uniform, then the value), no leading zero.
std::string number(Rng& rng, int digits) {
  const int n = 1 + int(rng.below(uint64_t(digits)));
  std::string s;
  for (int i = 0; i < n; ++i)
    s.push_back(char('0' + (i == 0 && n > 1 ? 1 + rng.below(9) : rng.below(10))));
  return s;
}

std::string add_decimal(const std::string& a, const std::string& b) {
  std::string out;
  int carry = 0;
  for (size_t i = 0; i < std::max(a.size(), b.size()) || carry; ++i) {
    int d = carry;
    if (i < a.size()) d += a[a.size() - 1 - i] - '0';
    if (i < b.size()) d += b[b.size() - 1 - i] - '0';
    out.push_back(char('0' + d % 10));
    carry = d / 10;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace

bool Task::in_held_out_split(std::string_view prompt) { return train::in_held_out_split(prompt); }

Problem Task::draw(Rng& rng) const {
  const int d = options_.difficulty;
  switch (options_.kind) {
    case TaskKind::kAdd: {
      const std::string a = number(rng, d), b = number(rng, d);
      return {a + "+" + b + "=", add_decimal(a, b)};
    }
    case TaskKind::kSort: {
      const int n = 1 + int(rng.below(uint64_t(d)));
      std::string digits;
      for (int i = 0; i < n; ++i) digits.push_back(char('0' + rng.below(10)));
      std::string sorted = digits;
      std::sort(sorted.begin(), sorted.end());
      return {"sort " + digits + "=", sorted};
    }
    case TaskKind::kReverse: {
      const int n = 1 + int(rng.below(uint64_t(d)));
      std::string word;
      for (int i = 0; i < n; ++i) word.push_back(char('a' + rng.below(26)));
      return {"rev " + word + "=", std::string(word.rbegin(), word.rend())};
    }
  }
  return {};
}

Problem Task::sample(Rng& rng) const {
  if (dataset_) {
    const std::vector<DatasetRow>& rows = dataset_->train();
    return problem_of(rows[size_t(rng.below(uint64_t(rows.size())))]);
  }
  // The held-out split is 1/8 of the problems: a few draws find a training one.
  for (;;) {
    Problem p = draw(rng);
    if (!in_held_out_split(p.prompt)) return p;
  }
}

std::vector<Problem> Task::held_out(int count, uint64_t seed) const {
  Rng rng(seed ^ 0x5eed5eedull);
  std::vector<Problem> out;
  if (dataset_) {  // the file's order: the first `count` held-out rows
    for (const DatasetRow& r : dataset_->held_out()) {
      if (int(out.size()) == count) break;
      out.push_back(problem_of(r));
    }
    return out;
  }
  // Small difficulties have few distinct problems: stop once no new one turns up.
  std::unordered_set<std::string> seen;
  for (int64_t tries = 0; int(out.size()) < count && tries < int64_t(count) * 200; ++tries) {
    Problem p = draw(rng);
    if (!in_held_out_split(p.prompt)) continue;
    if (!seen.insert(p.prompt).second) continue;
    out.push_back(std::move(p));
  }
  return out;
}

bool Task::answer_alphabet(char c) const {
  return options_.kind == TaskKind::kReverse ? (c >= 'a' && c <= 'z') : (c >= '0' && c <= '9');
}

bool Task::correct(const Problem& p, std::string_view completion, bool ended) const {
  if (dataset_) return verify(options_.verifier, completion, ended, p.answer);
  return ended && completion == p.answer;
}

Result<std::vector<Score>> Task::score(const Problem& p, std::span<const Completion> completions) {
  std::vector<Score> out;
  if (options_.reward_cmd.empty()) {
    for (const Completion& c : completions) {
      out.push_back({reward(p, c.text, c.ended), correct(p, c.text, c.ended)});
    }
    return out;
  }
  if (!reward_process_) {
    WL_ASSIGN_OR_RETURN(reward_process_,
                        RewardProcess::start(options_.reward_cmd, options_.reward_timeout));
  }
  std::vector<RewardQuery> queries;
  for (const Completion& c : completions) {
    queries.push_back(
        {.prompt = p.prompt, .completion = c.text, .ended = c.ended, .row_json = p.row});
  }
  WL_ASSIGN_OR_RETURN(std::vector<RewardReply> replies, reward_process_->score(queries));
  for (const RewardReply& r : replies)
    out.push_back({r.reward, r.correct.value_or(r.reward >= 1.0)});
  return out;
}

double Task::reward_seconds() const { return reward_process_ ? reward_process_->seconds() : 0.0; }

bool Task::has_answers() const { return !dataset_ || dataset_->every_row_has_an_answer(); }

double Task::reward(const Problem& p, std::string_view completion, bool ended) const {
  if (correct(p, completion, ended)) return 1.0;
  if (dataset_) return 0.0;
  const bool well_formed =
      ended && !completion.empty() &&
      std::all_of(completion.begin(), completion.end(), [&](char c) { return answer_alphabet(c); });
  return well_formed ? options_.format_reward : 0.0;
}

int Task::max_prompt_bytes() const {
  if (dataset_) return int(dataset_->longest_prompt_bytes());
  const int d = options_.difficulty;
  switch (options_.kind) {
    case TaskKind::kAdd:
      return 2 * d + 2;
    case TaskKind::kSort:
      return d + 6;
    case TaskKind::kReverse:
      return d + 5;
  }
  return 0;
}

int Task::max_answer_bytes() const {
  if (dataset_) return int(dataset_->longest_answer_bytes());
  return options_.kind == TaskKind::kAdd ? options_.difficulty + 1 : options_.difficulty;
}

}  // namespace wl::rl
