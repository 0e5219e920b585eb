// The verifiable tasks: answers checked by independent arithmetic, rewards by rule, and the
// held-out split never met by training.
#include "weightlift/rl/tasks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

namespace wl::rl {
namespace {

Task make(TaskKind kind, int difficulty, double format_reward = 0.1) {
  Result<Task> t =
      Task::create({.kind = kind, .difficulty = difficulty, .format_reward = format_reward});
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return std::move(*t);
}

TEST(Tasks, AnswersAreRight) {
  Rng rng(1);
  const Task add = make(TaskKind::kAdd, 4), sort = make(TaskKind::kSort, 6),
             rev = make(TaskKind::kReverse, 5);
  for (int i = 0; i < 500; ++i) {
    const Problem a = add.sample(rng);
    const size_t plus = a.prompt.find('+');
    const long x = std::stol(a.prompt.substr(0, plus)),
               y = std::stol(a.prompt.substr(plus + 1, a.prompt.size() - plus - 2));
    EXPECT_EQ(a.answer, std::to_string(x + y)) << a.prompt;
    EXPECT_LE(int(a.prompt.size()), add.max_prompt_bytes());
    EXPECT_LE(int(a.answer.size()), add.max_answer_bytes());

    const Problem s = sort.sample(rng);
    std::string digits = s.prompt.substr(5, s.prompt.size() - 6);
    EXPECT_TRUE(std::is_sorted(s.answer.begin(), s.answer.end()));
    std::sort(digits.begin(), digits.end());
    EXPECT_EQ(s.answer, digits) << s.prompt;

    const Problem r = rev.sample(rng);
    const std::string word = r.prompt.substr(4, r.prompt.size() - 5);
    EXPECT_EQ(r.answer, std::string(word.rbegin(), word.rend())) << r.prompt;
    EXPECT_LE(int(r.answer.size()), rev.max_answer_bytes());
  }
}

TEST(Tasks, TrainingNeverMeetsTheHeldOutSet) {
  const Task add = make(TaskKind::kAdd, 2);
  const std::vector<Problem> held = add.held_out(64, 9);
  ASSERT_GE(held.size(), 20u);  // two-digit sums: about 1/8 of ~8,000 problems
  std::set<std::string> prompts;
  for (const Problem& p : held) {
    EXPECT_TRUE(Task::in_held_out_split(p.prompt));
    prompts.insert(p.prompt);
  }
  EXPECT_EQ(prompts.size(), held.size()) << "held-out problems repeat";
  EXPECT_EQ(add.held_out(64, 9)[5].prompt, held[5].prompt) << "not a fixed set";
  Rng rng(2);
  for (int i = 0; i < 20000; ++i) {
    const Problem p = add.sample(rng);
    ASSERT_FALSE(Task::in_held_out_split(p.prompt)) << p.prompt;
  }
}

TEST(Tasks, RewardsFollowTheRules) {
  const Task add = make(TaskKind::kAdd, 3);
  const Problem p{"12+30=", "42"};
  EXPECT_EQ(add.reward(p, "42", true), 1.0);
  EXPECT_EQ(add.reward(p, "42", false), 0.0);  // no end token: not an answer
  EXPECT_EQ(add.reward(p, "43", true), 0.1);   // well formed, wrong
  EXPECT_EQ(add.reward(p, "4 2", true), 0.0);  // not the answer's alphabet
  EXPECT_EQ(add.reward(p, "", true), 0.0);
  EXPECT_TRUE(add.correct(p, "42", true));
  const Task rev = make(TaskKind::kReverse, 3);
  EXPECT_EQ(rev.reward({"rev ab=", "ba"}, "ab", true), 0.1);
  EXPECT_EQ(rev.reward({"rev ab=", "ba"}, "12", true), 0.0);
  // By default a wrong answer earns nothing for its form.
  EXPECT_EQ(make(TaskKind::kAdd, 3, 0.0).reward(p, "43", true), 0.0);
  EXPECT_EQ(Task::create({}).value().reward(p, "43", true), 0.0);
}

TEST(Tasks, BadOptionsAreNamed) {
  Result<Task> t = Task::create({.difficulty = 0});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("`difficulty` 0"), std::string::npos);
  EXPECT_FALSE(Task::create({.difficulty = 10}).ok());
  EXPECT_FALSE(Task::create({.format_reward = 1.5}).ok());
  EXPECT_EQ(task_from_name("sort"), TaskKind::kSort);
  EXPECT_FALSE(task_from_name("chess").has_value());
}

}  // namespace
}  // namespace wl::rl
