#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "support/scratch_dir.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/train/brown.h"
#include "weightlift/train/schedule.h"
#include "weightlift/train/tokenizer.h"

namespace wl::train {
namespace {
namespace fs = std::filesystem;

// A directory of its own for each test and process: ctest runs tests in parallel, and other
// runs may share /tmp.
std::string fresh_dir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string d = ::testing::TempDir() + "/wl_train_" + std::to_string(::getpid()) + "_" +
                        info->name() + "_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  wl::testing::remove_at_exit(d);
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

}  // namespace
}  // namespace wl::train
