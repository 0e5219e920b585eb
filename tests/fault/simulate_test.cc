// The simulation's contract: one failure schedule for every strategy, a checkpoint rollback
// that replays exactly what a run without the loss would have done, and recoveries that keep
// training going.
#include "weightlift/fault/simulate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace wl::fault {
namespace {

// A token stream with structure to learn: a short repeating phrase with a counter in it.
std::vector<int64_t> stream(int64_t n, int64_t salt) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(((i % 11) * 17 + (i / 11 + salt) % 5) % 256);
  return out;
}

class SimulateTest : public ::testing::Test {
 protected:
  SimulationOptions options(Recovery r) const {
    SimulationOptions o;
    o.config = *model::preset("tiny");
    o.config.num_layers = 8;
    o.train_tokens = &train_;
    o.val_tokens = &val_;
    o.stages = 4;
    o.recovery = r;
    o.iterations = 12;
    o.batch = 4;
    o.seq = 16;
    o.micro_batches = 2;
    o.eval_every = 4;
    o.eval_windows = 8;
    return o;
  }
  std::vector<int64_t> train_ = stream(4000, 0), val_ = stream(1000, 3);
};

std::vector<std::pair<int64_t, std::vector<int>>> losses_of(const SimulationResult& r) {
  std::vector<std::pair<int64_t, std::vector<int>>> out;
  for (const LossRecord& l : r.losses) {
    std::vector<int> stages;
    for (const Rebuild& b : l.plan) stages.push_back(b.stage);
    out.emplace_back(l.iteration, stages);
  }
  return out;
}

TEST_F(SimulateTest, EveryStrategyMeetsTheSameFailures) {
  std::vector<std::vector<std::pair<int64_t, std::vector<int>>>> seen;
  for (Recovery r :
       {Recovery::kNone, Recovery::kCheckpoint, Recovery::kCheckFree, Recovery::kCheckFreePlus}) {
    SimulationOptions o = options(r);
    o.fail_prob = 0.08;
    o.fail_seed = 5;
    o.checkpoint_every = 3;
    const Result<SimulationResult> res = simulate(o);
    ASSERT_TRUE(res.ok()) << res.status().to_string();
    EXPECT_TRUE(std::isfinite(res->final_val_loss));
    for (const LossRecord& l : res->losses) EXPECT_TRUE(std::isfinite(l.loss_after));
    if (r == Recovery::kCheckpoint) {
      EXPECT_LT(res->progress, res->iterations);
    } else {
      EXPECT_EQ(res->progress, res->iterations);
    }
    seen.push_back(losses_of(*res));
  }
  ASSERT_FALSE(seen[0].empty()) << "the seed should lose some stage in 12 iterations";
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_EQ(seen[i], seen[0]) << i;
}

// A loss at iteration 8 with checkpoints every 5 rolls back to step 5, and the run then
// replays steps 6 and 7 on the same data: 13 iterations end where 11 without the loss end.
TEST_F(SimulateTest, CheckpointRollbackReplaysTheRunExactly) {
  SimulationOptions o = options(Recovery::kCheckpoint);
  o.checkpoint_every = 5;
  o.iterations = 13;
  o.eval_every = 0;
  o.scheduled = {{8, 2}};
  const Result<SimulationResult> lost = simulate(o);
  ASSERT_TRUE(lost.ok()) << lost.status().to_string();
  ASSERT_EQ(lost->losses.size(), 1u);
  EXPECT_EQ(lost->losses[0].rolled_back_to, 5);
  EXPECT_EQ(lost->progress, 11);
  SimulationOptions clean = options(Recovery::kCheckpoint);
  clean.checkpoint_every = 5;
  clean.iterations = 11;
  clean.eval_every = 0;
  const Result<SimulationResult> ref = simulate(clean);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(lost->final_val_loss, ref->final_val_loss);
}

TEST_F(SimulateTest, ALostStageChangesTheRunAndTrainingGoesOn) {
  SimulationOptions o = options(Recovery::kCheckFree);
  const Result<SimulationResult> clean = simulate(o);
  o.scheduled = {{6, 1}};
  const Result<SimulationResult> lost = simulate(o);
  ASSERT_TRUE(clean.ok() && lost.ok());
  ASSERT_EQ(lost->losses.size(), 1u);
  EXPECT_EQ(lost->losses[0].plan[0].kind, Rebuild::Kind::kAverage);
  EXPECT_NE(lost->final_val_loss, clean->final_val_loss);
  EXPECT_TRUE(std::isfinite(lost->final_val_loss));
  EXPECT_LT(lost->final_val_loss, lost->evaluations.front().val_loss * 1.5);
}

TEST_F(SimulateTest, RefusesWhatCannotRun) {
  SimulationOptions o = options(Recovery::kCheckFreePlus);
  o.stages = 2;
  EXPECT_EQ(simulate(o).status().code(), StatusCode::kInvalidArgument);
  o = options(Recovery::kCheckFree);
  o.scheduled = {{3, 9}};
  EXPECT_EQ(simulate(o).status().code(), StatusCode::kInvalidArgument);
  o = options(Recovery::kCheckFree);
  o.micro_batches = 3;
  EXPECT_EQ(simulate(o).status().code(), StatusCode::kInvalidArgument);
  o = options(Recovery::kCheckFreePlus);  // the swapped schedule needs pairs of micro-batches
  o.batch = 3;
  o.micro_batches = 1;
  EXPECT_EQ(simulate(o).status().code(), StatusCode::kInvalidArgument);
  o = options(Recovery::kCheckFree);
  o.scheduled = {{13, 1}};  // after the last iteration
  EXPECT_EQ(simulate(o).status().code(), StatusCode::kInvalidArgument);
  o = options(Recovery::kCheckFree);
  o.eval_windows = 2;  // less than one batch: no validation to report
  EXPECT_EQ(simulate(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wl::fault
