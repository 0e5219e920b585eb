// Training state you can trust, across ranks (ranks as threads): a checkpoint is verified
// file by file and tensor by tensor on load, and a failure on one rank fails every rank;
// a state that is not finite is never written, on any rank; RunGuard stops a run that goes
// non-finite (or, under f16, skips too many updates in a row) naming the step.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "train_ranks.h"
#include "weightlift/model/params.h"
#include "weightlift/parallel/run/checkpoint.h"
#include "weightlift/parallel/run/run_guard.h"

namespace wl::parallel {
namespace {

using namespace testing;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TrainOptions tiny_run(const std::string& out) {
  TrainOptions o;
  o.preset = "tiny";
  o.corpus_dir = make_corpus();
  o.batch = 4;
  o.seq = 16;
  o.steps = 4;
  o.eval_every = 0;
  o.eval_windows = 4;
  o.checkpoint_every = 2;
  o.layout.dp_mode = DpMode::kFsdp;
  o.out_dir = out;
  return o;
}

TEST(Trust, AChangedTensorInOneRanksFileFailsEveryRankNamingIt) {
  TrainOptions o = tiny_run(fresh_dir("run"));
  for (auto& r : train_on(2, o)) ASSERT_TRUE(r.ok()) << r.status().to_string();
  // Flip a bit of the last tensor's last element in rank 1's file of checkpoint-2.
  const std::string file = o.out_dir + "/checkpoint-2/rank-00001-of-00002.safetensors";
  std::string bytes = slurp(file);
  bytes[bytes.size() - 2] ^= 0x10;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  TrainOptions resumed = o;
  resumed.resume = o.out_dir + "/checkpoint-2";
  resumed.out_dir = fresh_dir("resumed");
  // The rank that reads the changed file says what changed; the other learns it failed.
  auto both = train_on(2, resumed);
  EXPECT_EQ(both[1].status().code(), StatusCode::kDataLoss) << both[1].status().to_string();
  EXPECT_EQ(both[0].status().code(), StatusCode::kAborted) << both[0].status().to_string();
  // Read in another layout (one process reads every piece), the same file is named.
  auto one = train_on(1, resumed);
  EXPECT_EQ(one[0].status().code(), StatusCode::kDataLoss);
  EXPECT_NE(one[0].status().message().find("rank-00001-of-00002.safetensors: tensor '"),
            std::string::npos)
      << one[0].status().message();
  EXPECT_NE(one[0].status().message().find("has checksum"), std::string::npos);
}

TEST(Trust, AFileFromAnotherCheckpointIsRefused) {
  TrainOptions o = tiny_run(fresh_dir("run"));
  for (auto& r : train_on(2, o)) ASSERT_TRUE(r.ok()) << r.status().to_string();
  // checkpoint-4's rank file is whole and valid, but not the one checkpoint-2 recorded.
  const std::string ck2 = o.out_dir + "/checkpoint-2/rank-00000-of-00002.safetensors";
  std::ofstream(ck2, std::ios::binary | std::ios::trunc)
      << slurp(o.out_dir + "/checkpoint-4/rank-00000-of-00002.safetensors");
  TrainOptions resumed = o;
  resumed.resume = o.out_dir + "/checkpoint-2";
  resumed.out_dir = fresh_dir("resumed");
  auto one = train_on(1, resumed);
  EXPECT_EQ(one[0].status().code(), StatusCode::kDataLoss);
  EXPECT_NE(one[0].status().message().find("not those state.json recorded"), std::string::npos)
      << one[0].status().message();
}

TEST(Trust, NonFiniteStateIsNeverWrittenOnAnyRank) {
  const model::ModelConfig config = model_config("tiny");
  const std::string dir = fresh_dir("ck") + "/checkpoint-1";
  run_data_parallel(2, config, {.dp_mode = DpMode::kZero1}, [&](DataParallel& dp) {
    const model::ParamLayout layout(config);
    std::vector<float> full(size_t(layout.total()), 0.01f);
    dp.set_params(full.data());
    // Rank 1 holds a negative second moment somewhere in its rows.
    for (const StateRows& r : dp.own_rows()) {
      if (dp.job_rank() == 1 && r.kind == StateKind::kV && r.rows.size() > 0) {
        r.data[0] = -1.0f;
        break;
      }
    }
    Status s = save_checkpoint(dir, dp, {.step = 1, .data_rng = {1, 2, 3, 4}});
    EXPECT_FALSE(s.ok());
    if (dp.job_rank() == 1) {
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
      EXPECT_NE(s.message().find("] = -1"), std::string::npos) << s.message();
    }
  });
  EXPECT_FALSE(std::filesystem::exists(dir));
  for (const auto& e :
       std::filesystem::directory_iterator(std::filesystem::path(dir).parent_path()))
    ADD_FAILURE() << "left behind: " << e.path();
}

TEST(RunGuard, StopsANonFiniteRunNamingTheStepAndTheLastCheckpoint) {
  RunGuard g;
  EXPECT_TRUE(g.after_update({.step = 1, .loss = 2.5}, model::Precision::kF32, 4.0).ok());
  g.saved("runs/x/checkpoint-1");
  Status s = g.after_update({.step = 2, .loss = NAN}, model::Precision::kF32, 4.0);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message().rfind("step 2: the loss is nan", 0), 0u) << s.message();
  EXPECT_NE(s.message().find("runs/x/checkpoint-1"), std::string::npos);
  s = g.after_update({.step = 3, .loss = 1, .grad_norm = INFINITY, .skipped = true},
                     model::Precision::kBF16, 4.0);
  EXPECT_NE(s.message().find("step 3: the gradient is not finite"), std::string::npos);
  s = g.after_update({.step = 4, .loss = 1}, model::Precision::kF32, INFINITY);
  EXPECT_NE(s.message().find("step 4: the weights are no longer finite"), std::string::npos);
}

TEST(RunGuard, F16MaySkipButNotForever) {
  RunGuard g({.max_skips_in_a_row = 3});
  const train::StepMetrics skip{.loss = INFINITY, .skipped = true, .loss_scale = 1};
  int64_t step = 0;
  for (int round = 0; round < 2; ++round) {  // a clean update in between starts a new count
    for (int i = 0; i < 2; ++i) {
      train::StepMetrics m = skip;
      m.step = ++step;
      EXPECT_TRUE(g.after_update(m, model::Precision::kF16, 1.0).ok());
    }
    EXPECT_TRUE(g.after_update({.step = ++step, .loss = 1}, model::Precision::kF16, 1.0).ok());
  }
  Status s;
  for (int i = 0; i < 3; ++i) {
    train::StepMetrics m = skip;
    m.step = ++step;
    s = g.after_update(m, model::Precision::kF16, 1.0);
  }
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("step 9: f16 loss scaling skipped 3 updates in a row"),
            std::string::npos)
      << s.message();
}

TEST(RunGuard, WeightsSumOverEveryRank) {
  const model::ModelConfig config = model_config("tiny");
  run_data_parallel(2, config, {.dp_mode = DpMode::kFsdp}, [&](DataParallel& dp) {
    const model::ParamLayout layout(config);
    std::vector<float> full(size_t(layout.total()), 0.5f);
    dp.set_params(full.data());
    Result<double> sum = weights_sum_squares(dp);
    ASSERT_TRUE(sum.ok());
    EXPECT_DOUBLE_EQ(*sum, 0.25 * double(layout.total()));
    for (const StateRows& r : dp.own_rows()) {
      if (dp.job_rank() == 0 && r.kind == StateKind::kWeights && r.rows.size() > 0) {
        r.data[0] = NAN;
        break;
      }
    }
    EXPECT_TRUE(std::isnan(*weights_sum_squares(dp)));  // on both ranks
  });
}

}  // namespace
}  // namespace wl::parallel
