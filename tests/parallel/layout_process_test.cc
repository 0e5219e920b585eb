// Every training layout as the real command in real processes (`weightlift launch -n 2 --
// weightlift train ...`) ends a run with the weights one process ends it with: the same
// corpus, seed and global batch, three AdamW steps, every tensor of model.safetensors compared.
// The ranks-as-threads layout tests (layout_test.cc) hold the arithmetic to the same bar; this
// holds the command, the launcher, the processes and the saved file to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"
#include "train_ranks.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/model/config.h"

namespace wl::parallel {
namespace {

using namespace std::chrono_literals;

const std::string kBinary = wl::testing::beside_binary(WL_WEIGHTLIFT_BINARY);

// Each tensor of a model.safetensors, as floats.
std::map<std::string, std::vector<float>> read_weights(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  EXPECT_TRUE(file.ok()) << file.status().to_string();
  if (!file.ok()) return out;
  for (const TensorInfo& info : file->tensors()) {
    const std::string& name = info.name;
    Result<Tensor> t = file->get(name);
    EXPECT_TRUE(t.ok()) << name << ": " << t.status().to_string();
    if (!t.ok()) continue;
    EXPECT_EQ(t->dtype(), DType::kF32) << name;
    const float* p = t->data<float>();
    out[name].assign(p, p + t->numel());
  }
  return out;
}

// Runs `argv` to its end and returns its exit code; its output goes to the test's log.
int run(const std::vector<std::string>& argv) {
  wl::testing::Child c = wl::testing::spawn_child(argv, {});
  const int code = wl::testing::wait_exit(c, comm::deadline_after(240s));
  if (code != 0) ADD_FAILURE() << c.output;
  wl::testing::reap(c);
  return code;
}

struct Layout {
  const char* name;
  std::vector<std::string> flags;
  // The one process's too: the same micro-batches sum the same rows in the same order (a
  // pipeline's two micro-batches against one whole batch differ by AdamW's amplification of
  // gradients near 0, 5e-5 at one weight after three steps).
  std::vector<std::string> both = {};
};

class LayoutAsProcesses : public ::testing::TestWithParam<Layout> {};

// After three steps the weights differ only by the order in which the ranks' sums add up (a
// few ulps of each gradient: 1e-7 relative in f32), which AdamW turns into a few ulps of an
// update of at most lr = 1e-3. Measured: 4.3e-8 (tp), 1.9e-8 (ddp, zero1, zero2, fsdp),
// 3.7e-9 (ep), 0 (pp, against one process of the same micro-batches). 1e-6 is 20x the worst
// and far below what a lost gradient share or a step on the wrong rows moves a weight: a whole
// update, 1e-3.
constexpr double kWeightTolerance = 1e-6;

TEST_P(LayoutAsProcesses, EndsWithTheSingleProcessWeights) {
  const std::string corpus = testing::make_corpus();
  const std::vector<std::string> common = {
      "--threads", "1",      "train", "--preset",     "tiny",    "--corpus", corpus,
      "--batch",   "4",      "--seq", "32",           "--steps", "3",        "--lr",
      "1e-3",      "--seed", "5",     "--eval-every", "0",       "--quiet"};
  const std::string one = testing::fresh_dir("one"), two = testing::fresh_dir("two");
  std::vector<std::string> alone = {kBinary};
  alone.insert(alone.end(), common.begin(), common.end());
  alone.insert(alone.end(), GetParam().both.begin(), GetParam().both.end());
  alone.insert(alone.end(), {"--out", one});
  ASSERT_EQ(run(alone), 0);
  std::vector<std::string> launched = {kBinary, "launch", "-n", "2", "--", kBinary};
  launched.insert(launched.end(), common.begin(), common.end());
  launched.insert(launched.end(), GetParam().flags.begin(), GetParam().flags.end());
  launched.insert(launched.end(), GetParam().both.begin(), GetParam().both.end());
  launched.insert(launched.end(), {"--out", two});
  ASSERT_EQ(run(launched), 0);

  const auto a = read_weights(one + "/model.safetensors");
  const auto b = read_weights(two + "/model.safetensors");
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  std::string where;
  for (const auto& [name, x] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    const std::vector<float>& y = b.at(name);
    ASSERT_EQ(x.size(), y.size()) << name;
    for (size_t i = 0; i < x.size(); ++i) {
      const double d = std::fabs(double(x[i]) - double(y[i]));
      if (!(d <= worst)) {
        worst = d;
        where = name + "[" + std::to_string(i) + "]";
      }
    }
  }
  EXPECT_LE(worst, kWeightTolerance) << "worst at " << where;
  std::printf("%s: largest weight difference from one process %.3g at %s\n", GetParam().name, worst,
              where.c_str());
}

INSTANTIATE_TEST_SUITE_P(Layouts, LayoutAsProcesses,
                         ::testing::Values(Layout{"ddp", {"--dp-mode", "ddp"}},
                                           Layout{"zero1", {"--dp-mode", "zero1"}},
                                           Layout{"zero2", {"--dp-mode", "zero2"}},
                                           Layout{"fsdp", {"--dp-mode", "fsdp"}},
                                           Layout{"pp", {"--pp", "2"}, {"--micro-batches", "2"}},
                                           Layout{"ep", {"--ep", "2"}},
                                           Layout{"tp", {"--tp", "2"}}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace wl::parallel
