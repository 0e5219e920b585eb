// The RL step's decisions without any process: made-up rounds in, kept samples, dynamic-
// sampling refills, staleness drops and "push now" out (rl/orchestrator.h).
#include "weightlift/rl/orchestrator.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace wl::rl {
namespace {

Task sort_task() {
  Result<Task> t = Task::create({.kind = TaskKind::kSort, .difficulty = 3});
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return std::move(*t);
}

// A completion of `p` made by `version`: its answer (right) or a wrong one, then the end token.
Sample answer(const Task& task, const Problem& p, bool right, uint64_t version) {
  Sample s;
  s.prompt = task.prompt_ids(p);
  s.completion = task.codec().encode_answer(right ? p.answer : p.answer + "0");
  s.completion.push_back(task.codec().eos());
  s.logprobs.assign(s.completion.size(), -0.5);
  s.version = version;
  return s;
}

// Round `r`'s samples: group i answered right where rights[i][k].
void answer_round(const Task& task, Round& r, const std::vector<std::vector<bool>>& rights,
                  uint64_t version = 0) {
  ASSERT_EQ(rights.size(), r.problems.size());
  for (size_t i = 0; i < rights.size(); ++i)
    for (bool right : rights[i]) r.samples.push_back(answer(task, r.problems[i], right, version));
  ASSERT_EQ(r.samples.size(), r.prompts.size());
}

TEST(Orchestrator, AFlatGroupIsReplacedByAFreshProblem) {
  Task task = sort_task();
  Orchestrator o({.prompts = 2, .group = 4, .max_resample_rounds = 4}, task);
  Rng rng(1);
  o.begin_step(1);
  ASSERT_EQ(o.refill(), 2);
  Round first = o.draw(2, rng);
  ASSERT_EQ(first.prompts.size(), 8u);
  EXPECT_EQ(first.prompts[0], task.prompt_ids(first.problems[0]));
  EXPECT_EQ(first.prompts[7], task.prompt_ids(first.problems[1]));
  // Group 1 is all right: every advantage is 0, it teaches nothing.
  answer_round(task, first, {{true, true, false, false}, {true, true, true, true}});
  ASSERT_TRUE(o.take(std::move(first)).ok());
  ASSERT_EQ(o.refill(), 1) << "one group kept, one to replace";
  Round second = o.draw(1, rng);
  answer_round(task, second, {{true, false, false, false}});
  ASSERT_TRUE(o.take(std::move(second)).ok());
  EXPECT_EQ(o.refill(), 0);
  StepRecord rec;
  const Kept kept = o.end_step(rec);
  EXPECT_EQ(kept.samples.size(), 8u);
  EXPECT_EQ(rec.trained, 8);
  EXPECT_EQ(rec.generations, 2);
  EXPECT_EQ(rec.groups_filtered, 1);
  EXPECT_DOUBLE_EQ(rec.train_accuracy, 3.0 / 8);
  EXPECT_DOUBLE_EQ(rec.reward_mean, 3.0 / 8);
  ASSERT_EQ(rec.staleness.size(), 1u);
  EXPECT_EQ(rec.staleness[0], 8);
  // Right answers get a positive advantage, wrong ones a negative.
  EXPECT_GT(kept.samples[0].advantage, 0);
  EXPECT_LT(kept.samples[3].advantage, 0);
  EXPECT_EQ(kept.samples[0].reward, 1);
}

TEST(Orchestrator, WithoutDynamicSamplingAFlatGroupIsTrainedOn) {
  Task task = sort_task();
  Orchestrator o({.prompts = 2, .group = 2, .dynamic_sampling = false}, task);
  Rng rng(2);
  o.begin_step(1);
  Round r = o.draw(o.refill(), rng);
  answer_round(task, r, {{true, false}, {false, false}});
  ASSERT_TRUE(o.take(std::move(r)).ok());
  EXPECT_EQ(o.refill(), 0);
  StepRecord rec;
  EXPECT_EQ(o.end_step(rec).samples.size(), 4u);
  EXPECT_EQ(rec.groups_filtered, 0);
}

TEST(Orchestrator, AStepWhoseGroupsAreAllFlatEndsWhenItsRoundsAreSpent) {
  Task task = sort_task();
  Orchestrator o({.prompts = 3, .group = 2, .max_resample_rounds = 3}, task);
  Rng rng(3);
  o.begin_step(1);
  int rounds = 0;
  while (const int64_t problems = o.refill()) {
    EXPECT_EQ(problems, 3) << "nothing kept: every round asks for all of them";
    Round r = o.draw(problems, rng);
    answer_round(task, r, {{false, false}, {true, true}, {false, false}});
    ASSERT_TRUE(o.take(std::move(r)).ok());
    ASSERT_LE(++rounds, 3);
  }
  StepRecord rec;
  EXPECT_TRUE(o.end_step(rec).samples.empty());
  EXPECT_EQ(rec.trained, 0);
  EXPECT_EQ(rec.generations, 3);
  EXPECT_EQ(rec.groups_filtered, 9);
  // A new step starts from nothing.
  o.begin_step(2);
  EXPECT_EQ(o.refill(), 3);
}

TEST(Orchestrator, ResponseTokensAreTheMeanOverEverySampleGeneratedFilteredOrNot) {
  Task task = sort_task();
  Orchestrator o({.prompts = 1, .group = 2}, task);
  Rng rng(4);
  o.begin_step(1);
  Round r = o.draw(o.refill(), rng);
  answer_round(task, r, {{true, true}});  // flat: filtered, but generated
  const double flat = double(r.samples[0].completion.size() + r.samples[1].completion.size());
  ASSERT_TRUE(o.take(std::move(r)).ok());
  Round again = o.draw(o.refill(), rng);
  answer_round(task, again, {{true, false}});
  const double kept =
      double(again.samples[0].completion.size() + again.samples[1].completion.size());
  ASSERT_TRUE(o.take(std::move(again)).ok());
  StepRecord rec;
  o.end_step(rec);
  EXPECT_DOUBLE_EQ(rec.response_tokens, (flat + kept) / 4);
}

TEST(Orchestrator, SamplesOlderThanTheStalenessBoundAreDroppedAndCounted) {
  Task task = sort_task();
  Orchestrator o({.prompts = 1, .group = 4, .max_staleness = 1}, task);
  for (int i = 0; i < 3; ++i) o.trained();
  ASSERT_EQ(o.version(), 3u);
  Rng rng(5);
  o.begin_step(1);
  Round r = o.draw(o.refill(), rng);
  const std::vector<bool> rights = {true, false, true, false};
  const uint64_t versions[] = {3, 2, 1, 0};
  for (size_t k = 0; k < 4; ++k)
    r.samples.push_back(answer(task, r.problems[0], rights[k], versions[k]));
  ASSERT_TRUE(o.take(std::move(r)).ok());
  StepRecord rec;
  const Kept kept = o.end_step(rec);
  ASSERT_EQ(kept.samples.size(), 2u);
  EXPECT_EQ(kept.samples[0].version, 3u);
  EXPECT_EQ(kept.samples[1].version, 2u);
  EXPECT_EQ(rec.stale_dropped, 2);
  EXPECT_EQ(rec.staleness, (std::vector<int64_t>{1, 1}));
}

// The pushes a run of `steps` steps makes at `eta`, and that every sample trained is within
// eta versions of the weights it was trained at.
int pushes(int64_t eta, int steps) {
  Task task = sort_task();
  Orchestrator o({.prompts = 1, .group = 2, .max_staleness = eta}, task);
  uint64_t server = 0;
  o.pushed(++server);  // the evaluation before RL pushes
  int count = 0;
  uint64_t round_made_by = 0;  // the workers' version when the next round was requested
  bool round_pending = false;
  for (int step = 1; step <= steps; ++step) {
    if (o.push_before_generating()) {
      o.pushed(++server);
      ++count;
      round_pending = false;  // drained; regenerated below at the new version
    }
    const uint64_t made = round_pending ? round_made_by : *o.policy_version_of(server);
    EXPECT_LE(o.version() - made, uint64_t(eta)) << "step " << step;
    if (o.overlaps()) {
      if (o.push_before_next_round()) {
        o.pushed(++server);
        ++count;
      }
      round_made_by = *o.policy_version_of(server);
      round_pending = true;
    }
    o.trained();
  }
  return count;
}

TEST(Orchestrator, WeightsArePushedEveryStepSynchronouslyAndAsOftenAsEtaNeedsOtherwise) {
  EXPECT_EQ(pushes(0, 6), 6);
  EXPECT_EQ(pushes(1, 6), 5) << "every step but the first, whose round the evaluation's made";
  EXPECT_EQ(pushes(2, 6), 2) << "every other step";
  EXPECT_EQ(pushes(3, 7), 2);
}

TEST(Orchestrator, ServerVersionsMapToThePolicyVersionsTheyPublished) {
  Task task = sort_task();
  Orchestrator o({}, task);
  o.trained();
  o.trained();
  o.pushed(7);
  EXPECT_EQ(o.policy_version_of(7), 2u);
  EXPECT_EQ(o.policy_version_of(3), std::nullopt) << "never published";
  o.trained();
  o.pushed(8);
  EXPECT_EQ(o.policy_version_of(8), 3u);
  EXPECT_EQ(o.policy_version_of(7), 2u);
  EXPECT_EQ(o.server_version(), 8u);
}

TEST(Orchestrator, APendingRoundIsHeldToWhatAReplyIsHeldTo) {
  Task task = sort_task();
  const OrchestratorOptions options{.group = 2, .max_new = 6, .vocab_size = 300};
  Orchestrator o(options, task);
  Rng rng(6);
  const Round drawn = o.draw(1, rng);
  const std::vector<Problem> problems = drawn.problems;
  const Sample good = answer(task, problems[0], true, 2);
  auto pending = [&](std::vector<Sample> samples, uint64_t updates = 3) {
    for (Sample& s : samples) s.prompt.clear();  // a checkpoint does not store them
    return o.pending(problems, std::move(samples), updates);
  };
  Result<Round> ok = pending({good, good});
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->samples[1].prompt, task.prompt_ids(problems[0])) << "prompts rebuilt";
  EXPECT_EQ(ok->prompts.size(), 2u);

  auto refused = [&](std::vector<Sample> samples, const std::string& says, uint64_t updates = 3) {
    Result<Round> r = pending(std::move(samples), updates);
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().to_string();
  };
  refused({good}, "1 samples for 1 problems of 2");
  refused({good, good}, "version 2 after the run's 1", 1);
  Sample longer = good;
  longer.logprobs.pop_back();
  refused({good, longer}, "sample 1:");
  Sample positive = good;
  positive.logprobs[0] = 0.25;
  refused({good, positive}, "sample 1, token 0");
  Sample outside = good;
  outside.completion[1] = 300;
  refused({good, outside}, "sample 1, token 1: 300");
  Sample too_long = good;
  too_long.completion.assign(7, 49);
  too_long.logprobs.assign(7, -1);
  refused({too_long, good}, "sample 0: 7 tokens");
  Sample routed = good;
  routed.routes = {0, 1};
  refused({good, routed}, "2 route entries, not 0");
}

TEST(Orchestrator, HeldOutAccuracyCountsRightAnswersThatEnd) {
  Task task = sort_task();
  Orchestrator o({}, task);
  const std::vector<Problem> held = task.held_out(4, 7);
  ASSERT_EQ(held.size(), 4u);
  std::vector<Sample> samples;
  for (size_t i = 0; i < held.size(); ++i) samples.push_back(answer(task, held[i], i != 1, 0));
  samples[2].completion.pop_back();  // right, but it never ended
  Result<double> accuracy = o.accuracy(held, samples);
  ASSERT_TRUE(accuracy.ok()) << accuracy.status().to_string();
  EXPECT_DOUBLE_EQ(*accuracy, 0.5);
  const auto [text, ended] = o.text_of(samples[0]);
  EXPECT_EQ(text, held[0].answer);
  EXPECT_TRUE(ended);
}

}  // namespace
}  // namespace wl::rl
