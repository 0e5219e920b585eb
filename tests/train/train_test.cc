#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "weightlift/core/safetensors.h"
#include "weightlift/train/brown.h"
#include "weightlift/train/schedule.h"
#include "weightlift/train/tokenizer.h"
#include "weightlift/train/trainer.h"

namespace wl::train {
namespace {
namespace fs = std::filesystem;

// A directory of its own for each test and process: ctest runs tests in parallel, and other
// runs may share /tmp.
std::string fresh_dir(const std::string& name) {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  const std::string d = testing::TempDir() + "/wl_train_" + std::to_string(::getpid()) + "_" +
                        info->name() + "_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Twenty small files in the corpus's own format.
std::string make_corpus() {
  const std::string dir = fresh_dir("corpus");
  const char* lines[] = {
      "\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ./.",
      "\tIt/pps recommended/vbd that/cs the/at city/nn ,/, which/wdt had/hvd charge/nn ,/, act/vb "
      "./.",
      "\tShe/pps was/bedz n't/* there/rb ;/. he/pps said/vbd so/rb (/( twice/rb )/) ./."};
  for (int i = 0; i < 20; ++i) {
    std::ofstream f(dir + "/ca" + (i < 10 ? "0" : "") + std::to_string(i));
    for (int r = 0; r < 30; ++r) f << lines[(i + r) % 3] << "\n\n";
  }
  return dir;
}

TEST(Brown, StripsTagsAndRestoresPunctuation) {
  EXPECT_EQ(detokenize_brown("\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ./.\n"),
            "The jury said \"no evidence\".\n");
  EXPECT_EQ(detokenize_brown("\tcity/nn ,/, 1/2/cd (/( yes/rb )/) ./.\n"), "city, 1/2 (yes).\n");
}

TEST(Brown, MissingCorpusSaysWhatToDo) {
  auto r = load_brown("/nonexistent/brown");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/brown"), std::string::npos);
  EXPECT_NE(r.status().message().find("setup.sh"), std::string::npos);
}

TEST(Brown, SplitIsFixed) {
  auto r = load_brown(make_corpus());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->train_files, 18);
  EXPECT_EQ(r->validation_files, 2);
}

TEST(Tokenizer, RoundTripsBytes) {
  const std::string s = "Caf\xc3\xa9 \"x\"\n";
  std::vector<int64_t> ids = encode(s);
  EXPECT_EQ(ids.front(), kBosToken);
  EXPECT_EQ(decode(ids), s);
}

TEST(Schedule, WarmupThenCosine) {
  LrSchedule s{.base_lr = 1.0, .min_lr = 0.1, .warmup_steps = 4, .total_steps = 14};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(9), 0.55, 1e-12);
  EXPECT_NEAR(s.at(14), 0.1, 1e-12);
  EXPECT_NEAR(s.at(100), 0.1, 1e-12);
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(f, l);) out.push_back(l);
  return out;
}

TEST(Trainer, ResumeContinuesBitExactly) {
  const std::string corpus = make_corpus();
  TrainOptions o;
  o.preset = "tiny";
  o.corpus_dir = corpus;
  o.batch = 2;
  o.seq = 32;
  o.steps = 6;
  o.eval_every = 0;
  o.eval_windows = 4;
  o.schedule = {.base_lr = 1e-2, .min_lr = 1e-3, .warmup_steps = 2};

  TrainOptions straight = o;
  straight.out_dir = fresh_dir("straight");
  ASSERT_TRUE(train(straight).ok());

  // The first run goes on to step 5 after checkpointing step 3; the resumed run redoes 4 and 5.
  TrainOptions first = o;
  first.out_dir = fresh_dir("first");
  first.stop_after = 5;
  first.checkpoint_every = 3;
  ASSERT_TRUE(train(first).ok());
  TrainOptions second = o;
  second.out_dir = first.out_dir;
  second.resume = first.out_dir + "/checkpoint-3";
  auto r = train(second);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->steps, 6);

  auto a = SafetensorsFile::open(straight.out_dir + "/model.safetensors");
  auto b = SafetensorsFile::open(first.out_dir + "/model.safetensors");
  ASSERT_TRUE(a.ok() && b.ok());
  for (const TensorInfo& t : a->tensors()) {
    Tensor x = *a->get(t.name), y = *b->get(t.name);
    ASSERT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes())) << t.name;
  }
  // The loss curve continues exactly: the same six loss values in both metrics files, steps
  // 4 and 5 of the first run replaced rather than repeated.
  std::vector<std::string> la = read_lines(straight.out_dir + "/metrics.jsonl");
  std::vector<std::string> lb = read_lines(first.out_dir + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    auto field = [](const std::string& l) { return l.substr(l.find("\"loss\""), 30); };
    EXPECT_EQ(field(la[i]), field(lb[i])) << "step " << i + 1;
    EXPECT_NE(lb[i].find("\"step\":" + std::to_string(i + 1) + ","), std::string::npos) << lb[i];
  }
  // A damaged metrics file is refused, naming the line, and left as it was.
  const std::string metrics = first.out_dir + "/metrics.jsonl";
  {
    std::ofstream f(metrics, std::ios::trunc);
    f << lb[0] << "\n"
      << "not json\n"
      << lb[2] << "\n";
  }
  auto damaged = train(second);
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss) << damaged.status().to_string();
  EXPECT_NE(damaged.status().message().find("metrics.jsonl:2"), std::string::npos)
      << damaged.status().to_string();
  EXPECT_EQ(read_lines(metrics).size(), 3u);
}

// f16 needs loss scaling: the scaler starts at 2^16 and halves whenever a scaled gradient
// overflows f16 (that update is skipped). Training must still proceed and lower the loss.
TEST(Trainer, F16WithDynamicLossScalingTrains) {
  TrainOptions o;
  o.preset = "tiny";
  o.corpus_dir = make_corpus();
  o.batch = 2;
  o.seq = 32;
  o.steps = 30;
  o.eval_every = 0;
  o.eval_windows = 2;
  o.precision = model::Precision::kF16;
  o.schedule = {.base_lr = 1e-2, .min_lr = 1e-3, .warmup_steps = 2};
  o.out_dir = fresh_dir("f16");
  auto r = train(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<std::string> lines = read_lines(o.out_dir + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 30u);
  auto number = [](const std::string& l, const std::string& key) {
    const size_t p = l.find("\"" + key + "\":");
    return std::stod(l.substr(p + key.size() + 3));
  };
  int skipped = 0;
  for (const std::string& l : lines) skipped += l.find("\"skipped\":true") != std::string::npos;
  EXPECT_LT(skipped, 30);
  EXPECT_LT(number(lines.back(), "loss"), number(lines.front(), "loss"));
  // The same run in f32 differs: f16 rounding really happened.
  TrainOptions f32 = o;
  f32.precision = model::Precision::kF32;
  f32.out_dir = fresh_dir("f32");
  ASSERT_TRUE(train(f32).ok());
  const std::vector<std::string> ref = read_lines(f32.out_dir + "/metrics.jsonl");
  EXPECT_NE(number(ref.back(), "loss"), number(lines.back(), "loss"));
}

TEST(Trainer, BadInputsAreClearErrors) {
  TrainOptions o;
  o.out_dir = fresh_dir("bad");
  o.preset = "huge";
  auto r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("huge"), std::string::npos);

  o.preset = "tiny";
  o.corpus_dir = "/nonexistent/brown";
  r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);

  o.corpus_dir = make_corpus();
  o.resume = o.out_dir + "/no-such-checkpoint";
  r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no-such-checkpoint"), std::string::npos);
}

}  // namespace
}  // namespace wl::train
