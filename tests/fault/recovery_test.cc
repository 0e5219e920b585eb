// The recovery rules, each against its definition computed here independently: the weighted
// average bit for bit, the fresh optimizer and learning-rate factor, the copy of a swap
// partner, the swapped order against one process running the swapped network, and which
// layouts and losses are refused.
#include "weightlift/fault/recovery.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "weightlift/core/random.h"
#include "weightlift/fault/staged_model.h"
#include "weightlift/model/transformer.h"

namespace wl::fault {
namespace {

using Kind = Rebuild::Kind;

model::ModelConfig eight_layers() {
  model::ModelConfig c = *model::preset("tiny");
  c.num_layers = 8;
  return c;
}

train::Batch random_batch(int64_t rows, int64_t seq, uint64_t seed) {
  Rng rng(seed);
  train::Batch b{rows, seq, {}, {}};
  for (int64_t i = 0; i < rows * seq; ++i) {
    b.tokens.push_back(int64_t(rng.below(256)));
    b.targets.push_back(int64_t(rng.below(256)));
  }
  return b;
}

// Clipping at 100 leaves every stage's norm its own (clipped to 1, two stages would both have
// norm 1 and the average could not tell its neighbours apart).
std::unique_ptr<StagedModel> trained_model(int stages, int steps) {
  auto m = *StagedModel::create(eight_layers(), stages,
                                {.beta2 = 0.999, .weight_decay = 0, .grad_clip = 100}, 7);
  for (int i = 0; i < steps; ++i) {
    EXPECT_TRUE(m->step(random_batch(4, 16, 100 + i), 2, {m->normal_order()}, 1e-3).ok());
  }
  return m;
}

// A model with dense layers: the router's aux and z are the mean over the layers that route,
// as one process weighs them (StagePass::router_terms), not over every layer. Two stages of
// a dense layer and a MoE one each, two micro-batches, against one process per micro-batch.
TEST(StagedModel, RouterLossesOfAModelWithDenseLayersAreOneProcesss) {
  model::ModelConfig c = *model::preset("tiny");
  c.num_layers = 4;
  c.dense_layers = {0, 2};
  c.dense_ffn_dim = 2 * c.hidden_size;
  c.z_loss_beta = 1e-3;
  auto m = StagedModel::create(c, 2, {.beta2 = 0.999, .weight_decay = 0, .grad_clip = 100}, 7);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const std::vector<float> w((*m)->weights().begin(), (*m)->weights().end());
  const train::Batch b = random_batch(4, 16, 31);
  double want = 0;
  for (int mb = 0; mb < 2; ++mb) {
    model::Transformer t(c);
    std::copy(w.begin(), w.end(), t.params().data<float>());
    t.zero_grads();
    const model::LossTerms lt = t.forward_backward(b.tokens.data() + mb * 2 * 16,
                                                   b.targets.data() + mb * 2 * 16, 2, 16, {});
    want += (lt.aux + lt.z) / 2;
  }
  const Result<StepLoss> got = (*m)->step(b, 2, {(*m)->normal_order()}, 1e-3);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_GT(want, 0);
  EXPECT_NEAR(got->loss - got->ce, want, 1e-6 * want);
}

TEST(RecoveryPlan, AveragesInteriorStagesAndCopiesAtTheEnds) {
  const int lost_mid[] = {2};
  std::vector<Rebuild> p = *plan_recovery(Recovery::kCheckFree, 5, lost_mid);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].kind, Kind::kAverage);
  EXPECT_EQ(p[0].left, 1);
  EXPECT_EQ(p[0].right, 3);
  const int lost_end[] = {4};
  p = *plan_recovery(Recovery::kCheckFree, 5, lost_end);
  EXPECT_EQ(p[0].kind, Kind::kCopy);
  EXPECT_EQ(p[0].left, 3);
}

TEST(RecoveryPlan, CheckFreePlusCopiesSwapPartners) {
  for (auto [lost, partner] : {std::pair{0, 1}, {1, 0}, {4, 5}, {5, 4}}) {
    const int l[] = {lost};
    const std::vector<Rebuild> p = *plan_recovery(Recovery::kCheckFreePlus, 6, l);
    EXPECT_EQ(p[0].kind, Kind::kCopy) << lost;
    EXPECT_EQ(p[0].left, partner) << lost;
  }
  const int mid[] = {3};
  EXPECT_EQ(plan_recovery(Recovery::kCheckFreePlus, 6, mid)->at(0).kind, Kind::kAverage);
}

TEST(RecoveryPlan, AdjacentLossesNeverRebuildFromARebuiltStage) {
  const int two[] = {3, 2};
  std::vector<Rebuild> p = *plan_recovery(Recovery::kCheckFree, 6, two);
  ASSERT_EQ(p.size(), 2u);
  for (const Rebuild& b : p) {
    EXPECT_EQ(b.kind, Kind::kAverage);
    EXPECT_EQ(b.left, 1);
    EXPECT_EQ(b.right, 4);
  }
  // A swap pair lost together: neither can copy the other.
  const int pair[] = {0, 1};
  p = *plan_recovery(Recovery::kCheckFreePlus, 6, pair);
  EXPECT_EQ(p[0].kind, Kind::kCopy);
  EXPECT_EQ(p[0].left, 2);
  EXPECT_EQ(p[1].kind, Kind::kCopy);
  EXPECT_EQ(p[1].left, 2);
}

TEST(RecoveryPlan, RefusesLayoutsAndLossesItCannotRecover) {
  const int one[] = {0};
  EXPECT_EQ(plan_recovery(Recovery::kCheckFree, 2, one).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_recovery(Recovery::kCheckFreePlus, 3, one).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(plan_recovery(Recovery::kCheckpoint, 1, one).ok());
  const int all[] = {0, 1, 2};
  EXPECT_EQ(plan_recovery(Recovery::kCheckFree, 3, all).status().code(),
            StatusCode::kFailedPrecondition);
  const int outside[] = {3};
  EXPECT_EQ(plan_recovery(Recovery::kCheckFree, 3, outside).status().code(),
            StatusCode::kInvalidArgument);
  const int twice[] = {1, 1};
  EXPECT_EQ(plan_recovery(Recovery::kCheckFree, 3, twice).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_recovery("checkfree++").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*parse_recovery("checkfree+"), Recovery::kCheckFreePlus);
}

TEST(StagedModel, RefusesStagesThatDoNotDivideTheLayers) {
  EXPECT_EQ(StagedModel::create(eight_layers(), 3, {}, 1).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(StagedModel, AverageIsTheFormulaBitForBitWithAFreshOptimizer) {
  std::unique_ptr<StagedModel> m = trained_model(4, 3);
  const std::vector<float> left(m->stage_weights(0).begin(), m->stage_weights(0).end());
  const std::vector<float> right(m->stage_weights(2).begin(), m->stage_weights(2).end());
  const double gl = m->grad_norm(0), gr = m->grad_norm(2);
  // Norms a few percent apart: weights that were swapped, or one norm used for both, would
  // change nearly every float of the result.
  ASSERT_GT(std::fabs(gl - gr), 0.01 * std::max(gl, gr)) << gl << " " << gr;
  m->rebuild({.stage = 1, .kind = Kind::kAverage, .left = 0, .right = 2}, 1.1, 0);
  const std::span<const float> got = m->stage_weights(1);
  ASSERT_EQ(got.size(), left.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < left.size(); ++i) {
    const double a = gr + 1e-4, b = gl + 1e-4;  // each neighbour weighted by its own norm
    const float want = float((b * double(left[i]) + a * double(right[i])) / (a + b));
    mismatches += got[i] != want;
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_EQ(m->optimizer_steps(1), 0);
  EXPECT_EQ(m->optimizer_steps(0), 3);
  EXPECT_DOUBLE_EQ(m->lr_factor(1), 1.1);
  EXPECT_DOUBLE_EQ(m->lr_factor(0), 1.0);
  // Zero moments and step 0: the next update of the stage is Adam's first step at lr * 1.1,
  // lr * 1.1 * g / (|g| + eps) per element for the clipped gradient g, whatever the history.
  const StagedModel::State before = m->state();
  ASSERT_TRUE(m->step(random_batch(4, 16, 999), 2, {m->normal_order()}, 1e-3).ok());
  const std::span<const float> after = m->stage_weights(1);
  const std::span<const float> grads = m->gradients();
  const size_t offset = size_t(after.data() - m->weights().data());
  double sum_squares = 0;
  for (size_t i = 0; i < after.size(); ++i)
    sum_squares += double(grads[offset + i]) * grads[offset + i];
  const double clip = m->grad_norm(1) / std::sqrt(sum_squares);
  size_t checked = 0;
  for (size_t i = 0; i < after.size(); i += 97) {
    const double g = std::fabs(double(grads[offset + i]) * clip);
    const double want = 1.1e-3 * g / (g + 1e-8);
    EXPECT_NEAR(std::fabs(double(after[i]) - double(before.weights[offset + i])), want, 2e-8) << i;
    ++checked;
  }
  EXPECT_GT(checked, 100u);
}

TEST(StagedModel, CopyGivesThePartnerExactly) {
  std::unique_ptr<StagedModel> m = trained_model(4, 2);
  m->rebuild({.stage = 3, .kind = Kind::kCopy, .left = 2}, 1.1, 0);
  const std::span<const float> a = m->stage_weights(3), b = m->stage_weights(2);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
}

TEST(StagedModel, FreshStageIsTheInitOfItsSeed) {
  std::unique_ptr<StagedModel> m = trained_model(4, 2);
  m->rebuild({.stage = 2, .kind = Kind::kFresh}, 1.0, 55);
  std::vector<float> fresh(size_t(m->layout().total()));
  model::init_params(m->config(), m->layout(), 55, fresh.data());
  const std::span<const float> got = m->stage_weights(2);
  const int64_t offset = got.data() - m->weights().data();
  EXPECT_TRUE(std::equal(got.begin(), got.end(), fresh.begin() + offset));
}

// CheckFree+'s schedule, micro-batch 0 in order and micro-batch 1 swapped, is one process's
// passes over two networks: the network as it is on the first half of the batch, and the
// network whose layers are in the swapped order on the second. The loss is theirs together,
// and each stage's gradient the sum of its gradients at the position it ran in in each.
TEST(StagedModel, SwappedMicroBatchesAreTheSwappedNetwork) {
  std::unique_ptr<StagedModel> m = trained_model(4, 1);
  const std::vector<float> w(m->weights().begin(), m->weights().end());
  const std::vector<std::vector<int>> orders = {m->normal_order(), m->swapped_order()};
  ASSERT_EQ(orders[1], (std::vector<int>{1, 0, 3, 2}));
  const int64_t per = int64_t(m->stage_weights(0).size());
  const int64_t base = m->stage_weights(0).data() - m->weights().data();
  const int64_t total = m->layout().total();
  const train::Batch b = random_batch(4, 16, 31);
  int64_t denom = 0;
  for (int64_t t : b.targets) denom += t != -100;
  // Each micro-batch on its own network, position p holding stage order[p]'s layers.
  std::vector<double> want_grad(size_t(total), 0.0);
  double want_ce = 0;
  for (int mb = 0; mb < 2; ++mb) {
    const std::vector<int>& order = orders[size_t(mb)];
    model::Transformer t(m->config());
    float* tw = t.params().data<float>();
    std::copy(w.begin(), w.end(), tw);
    for (int p = 0; p < 4; ++p) {
      std::copy_n(w.begin() + base + order[size_t(p)] * per, per, tw + base + p * per);
    }
    t.zero_grads();
    const model::LossTerms lt =
        t.forward_backward(b.tokens.data() + mb * 2 * 16, b.targets.data() + mb * 2 * 16, 2, 16,
                           {.ce_denominator = denom, .aux_weight = 0.5f});
    want_ce += lt.ce * double(lt.count) / double(denom);
    const float* tg = t.grads().data<float>();
    for (int64_t i = 0; i < total; ++i) {
      const bool in_stages = i >= base && i < base + 4 * per;
      // Position p's gradient belongs to the stage that ran there.
      const int64_t to =
          in_stages ? base + order[size_t((i - base) / per)] * per + (i - base) % per : i;
      want_grad[size_t(to)] += tg[i];
    }
  }
  const Result<StepLoss> got = m->step(b, 2, orders, 1e-3);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_NEAR(got->ce, want_ce, 1e-6);
  const std::span<const float> g = m->gradients();
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < total; ++i) {
    worst = std::max(worst, std::fabs(double(g[size_t(i)]) - want_grad[size_t(i)]));
    scale = std::max(scale, std::fabs(want_grad[size_t(i)]));
  }
  EXPECT_LE(worst, 1e-5 * scale) << "largest gradient " << scale;
  // A swapped schedule that did nothing would give the normal network's gradients: it must not.
  model::Transformer normal(m->config());
  std::copy(w.begin(), w.end(), normal.params().data<float>());
  normal.zero_grads();
  (void)normal.forward_backward(b.tokens.data(), b.targets.data(), 4, 16,
                                {.ce_denominator = denom});
  double apart = 0;
  for (int64_t i = base; i < base + 4 * per; ++i)
    apart = std::max(apart, std::fabs(double(g[size_t(i)]) - normal.grads().data<float>()[i]));
  EXPECT_GT(apart, 100 * worst);
}

}  // namespace
}  // namespace wl::fault
