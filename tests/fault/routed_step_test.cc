// The pipeline that may lose stages, one thread per stage process, against the pipeline with
// every stage in one process (staged_model.h, what the simulation runs): the same micro-batches
// along the same routes, the same per-group clipping and AdamW, so after a few steps every
// process holds what the single process holds of its stage. Under CheckFree+'s swapped
// routes too, and the replicas of the ends keep the owners' bits.
#include "weightlift/fault/routed_step.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <thread>

#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/fault/stage_route.h"
#include "weightlift/fault/staged_model.h"
#include "weightlift/parallel/run/state_bytes.h"

namespace wl::fault {
namespace {

constexpr int kStages = 4;

std::vector<int64_t> stream(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(((i % 13) * 19 + (i / 13) % 7) % 256);
  return out;
}

model::ModelConfig four_layers() {
  model::ModelConfig c = *model::preset("tiny");
  c.num_layers = 4;
  return c;
}

train::AdamWOptions adam() {
  return {.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .grad_clip = 0.3};
}

// What each process ends with: its held buffer's weights by unit, the losses, the replica.
struct StageResult {
  std::map<int, std::vector<float>> units;  // unit -> its weights
  std::vector<double> losses;
  std::vector<double> norms;   // the blocks group's post-clip norm after each step
  std::vector<float> replica;  // the replica's weights, when kept
  std::vector<float> end;      // the end unit's weights, when held
};

std::vector<StageResult> run_pipeline(const std::vector<train::Batch>& batches, bool swap,
                                      int micro_batches, double lr) {
  const model::ModelConfig c = four_layers();
  const model::ParamLayout layout(c);
  std::vector<float> full(size_t(layout.total()));
  model::init_params(c, layout, 7, full.data());
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<StageResult> out(kStages);
  std::vector<std::thread> threads;
  for (int s = 0; s < kStages; ++s) {
    threads.emplace_back([&, s] {
      auto group = comm::Group::connect(
          {.store = store, .rank = s, .size = kStages, .timeout = std::chrono::seconds(30)});
      ASSERT_TRUE(group.ok()) << group.status().to_string();
      parallel::ParallelLayout pl{.pp = kStages, .micro_batches = micro_batches};
      const model::Units units(c, layout);
      parallel::DataParallelOptions o{.layout = pl, .adamw = adam()};
      o.units = parallel::stage_units(c, units, pl, s).units;
      parallel::DataParallel dp(c, o, parallel::DataParallelRanks{.stages = *group});
      dp.set_params(full.data());
      StageOptimizer opt(dp, s, kStages, swap, adam());
      if (opt.replica_unit() >= 0) {
        const model::FlatRange r = units.range(opt.replica_unit());
        UnitState st{.data = Tensor::zeros(DType::kF32, {3, r.size()}), .group = {}};
        std::memcpy(st.data.data<float>(), full.data() + r.begin, size_t(r.size()) * 4);
        opt.set_replica_state(st);
      }
      RoutedStepOptions ro{.micro_batches = micro_batches, .orders = {normal_order(kStages)}};
      if (swap) ro.orders.push_back(swapped_order(kStages));
      for (const train::Batch& b : batches) {
        double waited = 0;
        auto shares = run_routed_passes(dp, opt, b, ro, &waited);
        ASSERT_TRUE(shares.ok()) << shares.status().to_string();
        auto totals = commit_step(dp, b, *shares);
        ASSERT_TRUE(totals.ok()) << totals.status().to_string();
        ASSERT_TRUE(opt.step(lr, totals->ends_sum_squares).ok());
        out[size_t(s)].losses.push_back(totals->loss.loss());
        out[size_t(s)].norms.push_back(opt.group(ClipGroup::kBlocks).norm);
      }
      for (int u : dp.held_units()) {
        const std::vector<train::AdamWSlice> sl = dp.unit_slices(u);
        std::vector<float>& w = out[size_t(s)].units[u];
        for (const train::AdamWSlice& x : sl) w.insert(w.end(), x.param, x.param + x.n);
      }
      if (opt.replica_unit() >= 0) {
        const UnitState st = opt.replica_state();
        const int64_t n = st.data.numel() / 3;
        out[size_t(s)].replica.assign(st.data.data<float>(), st.data.data<float>() + n);
      }
      if (opt.holds_ends() && swap) {
        const UnitState st = opt.end_state();
        const int64_t n = st.data.numel() / 3;
        out[size_t(s)].end.assign(st.data.data<float>(), st.data.data<float>() + n);
      }
      EXPECT_TRUE(comm::barrier(**group).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

class RoutedStep : public ::testing::TestWithParam<bool> {};

TEST_P(RoutedStep, EveryProcessHoldsWhatTheSingleProcessHoldsOfItsStage) {
  const bool swap = GetParam();
  const std::vector<int64_t> tokens = stream(5000);
  train::WindowSampler sampler(&tokens, 3);
  std::vector<train::Batch> batches;
  for (int i = 0; i < 3; ++i) batches.push_back(sampler.next(4, 16));
  const double lr = 3e-3;
  const std::vector<StageResult> got = run_pipeline(batches, swap, 2, lr);
  if (HasFatalFailure()) return;

  auto staged = StagedModel::create(four_layers(), kStages, adam(), 7);
  ASSERT_TRUE(staged.ok());
  std::vector<std::vector<int>> orders{(*staged)->normal_order()};
  if (swap) orders.push_back((*staged)->swapped_order());
  std::vector<double> losses;
  std::vector<std::vector<double>> norms(kStages);
  for (const train::Batch& b : batches) {
    auto l = (*staged)->step(b, 2, orders, lr);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    losses.push_back(l->loss);
    for (int s = 0; s < kStages; ++s) norms[size_t(s)].push_back((*staged)->grad_norm(s));
  }
  const model::ModelConfig c = four_layers();
  const model::ParamLayout layout(c);
  const model::Units units(c, layout);
  const std::span<const float> want = (*staged)->weights();
  // Same kernels on the same rows in the same order: the processes hold the single process's
  // bits. (Summing the loss over stages is the only reordering, and it only reports.)
  for (int s = 0; s < kStages; ++s) {
    for (const auto& [u, w] : got[size_t(s)].units) {
      const model::FlatRange r = units.range(u);
      ASSERT_EQ(int64_t(w.size()), r.size());
      EXPECT_EQ(std::memcmp(w.data(), want.data() + r.begin, w.size() * sizeof(float)), 0)
          << "stage " << s << " unit " << u;
    }
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(got[size_t(s)].losses[i], losses[i], 1e-6 * losses[i]) << "step " << i;
      EXPECT_EQ(got[size_t(s)].norms[i], norms[size_t(s)][i]) << "stage " << s << " step " << i;
    }
  }
  if (!swap) return;
  // CheckFree+'s replicas: the second process's embedding and the second-to-last's head are
  // the owners' bits after every step.
  ASSERT_FALSE(got[1].replica.empty());
  ASSERT_FALSE(got[kStages - 2].replica.empty());
  EXPECT_EQ(got[1].replica, got[0].end);
  EXPECT_EQ(got[kStages - 2].replica, got[kStages - 1].end);
}

INSTANTIATE_TEST_SUITE_P(Orders, RoutedStep, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "swapped" : "normal"; });

TEST(StageRoute, SwappedRoutesVisitTheEndProcessesTwice) {
  const model::ModelConfig c = four_layers();
  const model::ParamLayout layout(c);
  const model::Units units(c, layout);
  const std::vector<model::Stage> blocks = {{1, 1}, {2, 2}, {3, 3}, {4, 4}};
  const std::vector<Segment> normal = route(blocks, units.head(), normal_order(4));
  ASSERT_EQ(normal.size(), 4u);
  EXPECT_EQ(normal[0].process, 0);
  EXPECT_EQ(normal[0].units.first, 0);
  EXPECT_EQ(normal[0].units.last, 1);
  EXPECT_EQ(normal[3].units.last, units.head());
  const std::vector<Segment> swapped = route(blocks, units.head(), swapped_order(4));
  std::vector<int> procs;
  for (const Segment& s : swapped) procs.push_back(s.process);
  EXPECT_EQ(procs, (std::vector<int>{0, 1, 0, 3, 2, 3}));
  EXPECT_EQ(swapped[1].units.first, 2);
  EXPECT_EQ(swapped[2].units.first, 1);
  EXPECT_EQ(swapped[5].units.first, units.head());
}

}  // namespace
}  // namespace wl::fault
