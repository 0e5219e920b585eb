// orchestrator.h.
#include "weightlift/rl/orchestrator.h"

#include <algorithm>
#include <cmath>

#include "weightlift/core/check.h"

namespace wl::rl {

Orchestrator::Orchestrator(const OrchestratorOptions& options, Task& task)
    : o_(options), task_(task) {}

void Orchestrator::pushed(uint64_t server_version) {
  server_version_ = server_version;
  published_[server_version] = updates_;
  workers_version_ = updates_;
}

std::optional<uint64_t> Orchestrator::policy_version_of(uint64_t server_version) const {
  auto it = published_.find(server_version);
  if (it == published_.end()) return std::nullopt;
  return it->second;
}

bool Orchestrator::push_before_generating() const {
  return !overlaps() || workers_version_ + uint64_t(o_.max_staleness) < updates_;
}

bool Orchestrator::push_before_next_round() const {
  return workers_version_ + uint64_t(o_.max_staleness) < updates_ + 1;
}

Round Orchestrator::draw(int64_t problems, Rng& rng) const {
  Round r;
  for (int64_t i = 0; i < problems; ++i) {
    r.problems.push_back(task_.sample(rng));
    for (int64_t k = 0; k < o_.group; ++k) r.prompts.push_back(task_.prompt_ids(r.problems.back()));
  }
  return r;
}

Result<Round> Orchestrator::pending(std::vector<Problem> problems, std::vector<Sample> samples,
                                    uint64_t updates) const {
  if (samples.size() != problems.size() * size_t(o_.group)) {
    return data_loss(std::to_string(samples.size()) + " samples for " +
                     std::to_string(problems.size()) + " problems of " + std::to_string(o_.group));
  }
  Round r;
  r.problems = std::move(problems);
  for (const Problem& p : r.problems) {
    for (int64_t k = 0; k < o_.group; ++k) r.prompts.push_back(task_.prompt_ids(p));
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    Sample& s = samples[i];
    s.prompt = r.prompts[i];
    const std::string which = "sample " + std::to_string(i);
    if (s.version > updates) {
      return data_loss(which + ": version " + std::to_string(s.version) + " after the run's " +
                       std::to_string(updates));
    }
    if (s.logprobs.size() != s.completion.size() || int64_t(s.completion.size()) > o_.max_new) {
      return data_loss(which + ": " + std::to_string(s.completion.size()) + " tokens, " +
                       std::to_string(s.logprobs.size()) + " log-probabilities");
    }
    // Routes for the tokens fed: the prompt, the completion but its last token.
    const size_t routes =
        s.completion.empty() ? 0 : (s.prompt.size() + s.completion.size() - 1) * o_.route_width;
    if (s.routes.size() != routes) {
      return data_loss(which + ": " + std::to_string(s.routes.size()) + " route entries, not " +
                       std::to_string(routes));
    }
    for (size_t t = 0; t < s.completion.size(); ++t) {
      if (s.completion[t] < 0 || s.completion[t] >= o_.vocab_size ||
          !std::isfinite(s.logprobs[t]) || s.logprobs[t] > 0) {
        return data_loss(which + ", token " + std::to_string(t) + ": " +
                         std::to_string(s.completion[t]) + " with log-probability " +
                         std::to_string(s.logprobs[t]));
      }
    }
  }
  r.samples = std::move(samples);
  return r;
}

void Orchestrator::begin_step(int64_t step) {
  step_ = step;
  record_ = StepRecord{};
  kept_ = Kept{};
  generated_ = 0;
}

int64_t Orchestrator::refill() {
  const auto kept = int64_t(kept_.samples.size());
  if (kept >= o_.prompts * o_.group || record_.generations >= o_.max_resample_rounds) return 0;
  ++record_.generations;
  return o_.prompts - kept / o_.group;
}

Status Orchestrator::take(Round round) {
  for (const Sample& s : round.samples) {
    record_.response_tokens += double(s.completion.size());
    ++generated_;
  }
  for (size_t i = 0; i < round.problems.size(); ++i) {
    WL_RETURN_IF_ERROR(keep_group(round, i, round.samples));
  }
  return ok_status();
}

// Group i of a round scored; its samples kept unless the group is flat (under dynamic
// sampling) or a sample is more than max_staleness versions behind.
Status Orchestrator::keep_group(const Round& round, size_t i, std::vector<Sample>& samples) {
  const Problem& problem = round.problems[i];
  const auto G = size_t(o_.group);
  std::vector<std::pair<std::string, bool>> texts;
  for (size_t k = 0; k < G; ++k) texts.push_back(text_of(samples[i * G + k]));
  std::vector<Completion> completions;
  for (const auto& [text, ended] : texts) completions.push_back({text, ended});
  Result<std::vector<Score>> scores = task_.score(problem, completions);
  if (!scores.ok()) {
    return scores.status().with_context("step " + std::to_string(step_) + ", scoring");
  }
  std::vector<double> rewards;
  for (const Score& sc : *scores) rewards.push_back(sc.reward);
  Result<std::vector<double>> advantages = group_advantages(rewards, o_.advantages);
  if (!advantages.ok()) {
    return advantages.status().with_context("step " + std::to_string(step_) + ", prompt '" +
                                            problem.prompt + "'");
  }
  const std::vector<double>& adv = *advantages;
  if (o_.dynamic_sampling && std::all_of(adv.begin(), adv.end(), [](double x) { return x == 0; })) {
    ++record_.groups_filtered;
    return ok_status();
  }
  for (size_t k = 0; k < G; ++k) {
    Sample& s = samples[i * G + k];
    s.reward = rewards[k];
    s.advantage = adv[k];
    // Trained against the weights of version updates_: this many versions behind.
    const uint64_t behind = updates_ - s.version;
    if (s.version > updates_ || behind > uint64_t(o_.max_staleness)) {
      ++record_.stale_dropped;
      continue;
    }
    if (record_.staleness.size() <= behind) record_.staleness.resize(behind + 1, 0);
    ++record_.staleness[behind];
    kept_.right += (*scores)[k].correct;
    kept_.reward_sum += rewards[k];
    kept_.samples.push_back(std::move(s));
  }
  return ok_status();
}

Kept Orchestrator::end_step(StepRecord& record) {
  record.generations = record_.generations;
  record.groups_filtered = record_.groups_filtered;
  record.staleness = record_.staleness;
  record.stale_dropped = record_.stale_dropped;
  record.response_tokens = generated_ > 0 ? record_.response_tokens / double(generated_) : 0;
  if (!kept_.samples.empty()) {
    const auto n = double(kept_.samples.size());
    record.trained = int64_t(kept_.samples.size());
    record.reward_mean = kept_.reward_sum / n;
    record.train_accuracy = double(kept_.right) / n;
  }
  return std::exchange(kept_, Kept{});
}

std::pair<std::string, bool> Orchestrator::text_of(const Sample& s) const {
  std::span<const int64_t> body = s.completion;
  const bool ended = !body.empty() && body.back() == task_.codec().eos();
  if (ended) body = body.first(body.size() - 1);
  std::optional<std::string> text = task_.codec().decode(body);
  if (!text) return {std::string(), false};  // a special token inside
  return {std::move(*text), ended};
}

Result<double> Orchestrator::accuracy(std::span<const Problem> problems,
                                      std::span<const Sample> samples) {
  WL_CHECK(problems.size() == samples.size())
      << problems.size() << " problems, " << samples.size() << " samples";
  int64_t right = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto [text, ended] = text_of(samples[i]);
    const Completion c{text, ended};
    WL_ASSIGN_OR_RETURN(std::vector<Score> score, task_.score(problems[i], {&c, 1}));
    right += score[0].correct;
  }
  return problems.empty() ? 0.0 : double(right) / double(problems.size());
}

}  // namespace wl::rl
