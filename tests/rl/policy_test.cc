// GRPO's advantages, the clipped and importance-weighted token loss, the sampler's
// log-probabilities, and the policy step's gradients against the cross-entropy's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "parallel/train_ranks.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/kernels/router.h"
#include "weightlift/kernels/sampling.h"
#include "weightlift/model/params.h"
#include "weightlift/rl/checkpoint.h"
#include "weightlift/rl/policy_step.h"
#include "weightlift/train/tokenizer.h"

namespace wl::rl {
namespace {

TEST(GroupAdvantages, NormaliseByTheGroupsStandardDeviation) {
  const std::vector<double> r = {1, 0, 0, 1};
  // mean 0.5, unbiased std sqrt(1/3)
  const std::vector<double> a = *group_advantages(r, {});
  EXPECT_NEAR(a[0], 0.5 / std::sqrt(1.0 / 3.0), 1e-5);
  EXPECT_NEAR(a[1], -0.5 / std::sqrt(1.0 / 3.0), 1e-5);
  const std::vector<double> dr = *group_advantages(r, {.normalize_std = false});
  EXPECT_EQ(dr[0], 0.5);
  EXPECT_EQ(dr[1], -0.5);
  const std::vector<double> flat = *group_advantages(std::vector<double>{0.1, 0.1, 0.1}, {});
  for (double x : flat) EXPECT_EQ(x, 0.0);
  EXPECT_EQ((*group_advantages(std::vector<double>{1.0}, {}))[0], 0.0);
  // A reward that is not a number is refused, naming the sample.
  Result<std::vector<double>> bad = group_advantages(std::vector<double>{1.0, NAN, 0.0}, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sample 1"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(group_advantages(std::vector<double>{INFINITY, 0.0}, {}).ok());
}

TEST(PolicyToken, ClipsOnlyWhereTheAdvantageWouldPushFurther) {
  const PolicyLossOptions o;  // clip 0.2 / 0.28, TIS cap 2
  // Ratio 1, no importance correction: gradient coefficient A / tokens.
  TokenTerm t = policy_token(-1.0, -1.0, -1.0, 2.0, 4.0, o);
  EXPECT_DOUBLE_EQ(t.ratio, 1.0);
  EXPECT_DOUBLE_EQ(t.coef, 0.5);
  EXPECT_DOUBLE_EQ(t.loss, -0.5);
  EXPECT_FALSE(t.clipped);
  // Ratio 1.5 with A > 0: past 1 + 0.28, clipped, no gradient.
  t = policy_token(std::log(1.5), 0.0, 0.0, 1.0, 1.0, o);
  EXPECT_TRUE(t.clipped);
  EXPECT_EQ(t.coef, 0.0);
  EXPECT_NEAR(t.loss, -1.28, 1e-12);
  // Ratio 1.5 with A < 0: the unclipped term is the smaller, gradient flows.
  t = policy_token(std::log(1.5), 0.0, 0.0, -1.0, 1.0, o);
  EXPECT_FALSE(t.clipped);
  EXPECT_NEAR(t.coef, -1.5, 1e-12);
  // Ratio 0.5 with A < 0: below 1 - 0.2, clipped.
  t = policy_token(std::log(0.5), 0.0, 0.0, -1.0, 1.0, o);
  EXPECT_TRUE(t.clipped);
  // The sampler gave the token half the trainer's probability: weight 2 (the cap); a quarter:
  // still 2.
  t = policy_token(0.0, 0.0, std::log(0.5), 1.0, 1.0, o);
  EXPECT_NEAR(t.is_weight, 2.0, 1e-12);
  t = policy_token(0.0, 0.0, std::log(0.25), 1.0, 1.0, o);
  EXPECT_EQ(t.is_weight, 2.0);
  EXPECT_EQ(policy_token(0.0, 0.0, std::log(0.25), 1.0, 1.0, {.tis_cap = 0}).is_weight, 1.0);
}

TEST(Sampling, LogprobIsUnderTheDistributionSampledFrom) {
  std::vector<float> logits = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f};
  Rng rng(3);
  // Temperature 1, no filter: log softmax of the logits.
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  for (int i = 0; i < 50; ++i) {
    double lp = 1;
    const int64_t tok = kernels::sample(logits.data(), 5, {.temperature = 1.0f}, rng, &lp);
    EXPECT_NEAR(lp, double(logits[size_t(tok)]) - std::log(z), 1e-6);
  }
  // Top-k 2 at temperature 0.5: the two largest, renormalised.
  const double a = std::exp(2.0 / 0.5), b = std::exp(1.0 / 0.5);
  for (int i = 0; i < 50; ++i) {
    double lp = 1;
    const int64_t tok =
        kernels::sample(logits.data(), 5, {.temperature = 0.5f, .top_k = 2}, rng, &lp);
    ASSERT_TRUE(tok == 2 || tok == 4);
    EXPECT_NEAR(lp, std::log((tok == 2 ? a : b) / (a + b)), 1e-6);
  }
}

model::ModelConfig tiny() { return *model::preset("tiny"); }

std::vector<Sample> samples_of(const model::ModelConfig& c, int n) {
  std::vector<Sample> out;
  Rng rng(11);
  for (int i = 0; i < n; ++i) {
    Sample s;
    s.prompt = train::encode("12+" + std::to_string(i) + "=");
    for (int j = 0; j < 3 + i % 3; ++j) s.completion.push_back(int64_t(rng.below(uint64_t(256))));
    s.completion.push_back(train::kEosToken);
    s.logprobs.assign(s.completion.size(), -3.0);
    s.advantage = i % 2 ? 1.0 : -0.5;
    out.push_back(s);
  }
  (void)c;
  return out;
}

std::vector<float> gradients(parallel::DataParallel& dp) {
  std::vector<float> g(size_t(dp.layout().total()));
  EXPECT_TRUE(dp.gather_grads(g.data()).ok());
  return g;
}

// token_loss with coefficient 1/count on every target is the mean cross-entropy: the same
// gradients as loss(), through the same step.
TEST(PolicyStep, TokenLossWithEqualCoefficientsIsTheCrossEntropy) {
  const model::ModelConfig c = tiny();
  parallel::DataParallel dp(c, {}, nullptr, nullptr);
  std::vector<float> w(size_t(dp.layout().total()));
  model::init_params(c, dp.layout(), 5, w.data());
  dp.set_params(w.data());
  const std::vector<Sample> s = samples_of(c, 6);
  Result<train::Batch> b = make_sft_batch(s, 16);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const parallel::StepSettings settings{.lr = 1e-3};
  Result<model::LossTerms> ce = parallel::compute_gradients(dp, *b, settings);
  ASSERT_TRUE(ce.ok());
  const std::vector<float> expected = gradients(dp);
  const double count = double(ce->count);
  parallel::MicroBatchLoss mine{
      .part =
          [&](model::StagePass& pass, parallel::RowRange rows) {
            return pass.token_loss(
                b->targets.data() + rows.begin * b->seq,
                [&](std::span<const double> logp, std::span<float> coef) {
                  double sum = 0;
                  for (size_t r = 0; r < logp.size(); ++r) {
                    if (b->targets[size_t(rows.begin * b->seq) + r] == kernels::kIgnoreIndex)
                      continue;
                    coef[r] = float(1.0 / count);
                    sum -= logp[r];
                  }
                  return sum;
                });
          },
      .divisor = count};
  Result<model::LossTerms> tl = parallel::compute_gradients(dp, *b, settings, mine);
  ASSERT_TRUE(tl.ok());
  EXPECT_NEAR(tl->ce, ce->ce, 1e-6 * ce->ce);
  const std::vector<float> got = gradients(dp);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, double(std::fabs(got[i] - expected[i])));
    scale = std::max(scale, double(std::fabs(expected[i])));
  }
  EXPECT_LE(worst, 1e-6 * scale) << "largest gradient " << scale;
}

// Mean log-probability of each sample's completion under the model's current weights.
std::vector<double> completion_logprobs(parallel::DataParallel& dp, const std::vector<Sample>& s) {
  Result<PolicyBatch> b = make_policy_batch(s, 16);
  EXPECT_TRUE(b.ok());
  std::vector<double> out(s.size(), 0.0);
  dp.set_evaluating(true);
  model::StagePass pass(dp.pass_model(), {0, dp.units().head()}, b->batch.tokens.data(),
                        b->batch.batch, b->batch.seq, {}, &dp);
  EXPECT_TRUE(pass.forward(nullptr, false).ok());
  pass.token_loss(b->batch.targets.data(), [&](std::span<const double> logp, std::span<float>) {
    for (size_t r = 0; r < logp.size(); ++r) {
      if (b->batch.targets[r] != kernels::kIgnoreIndex) out[r / 16] += logp[r];
    }
    return 0.0;
  });
  dp.set_evaluating(false);
  return out;
}

// A step makes completions with a positive advantage more likely and those with a negative
// one less likely; its statistics describe the batch.
TEST(PolicyStep, MovesProbabilityTowardsTheAdvantage) {
  const model::ModelConfig c = tiny();
  parallel::DataParallel dp(c, {}, nullptr, nullptr);
  std::vector<float> w(size_t(dp.layout().total()));
  model::init_params(c, dp.layout(), 5, w.data());
  dp.set_params(w.data());
  std::vector<Sample> s = samples_of(c, 4);
  const std::vector<double> before = completion_logprobs(dp, s);
  // The sampler's log-probabilities: the trainer's own, so the importance weights are 1.
  Result<PolicyBatch> b = make_policy_batch(s, 16);
  ASSERT_TRUE(b.ok());
  Result<PolicyStats> st = policy_step(dp, *b, {.lr = 3e-3}, {});
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->tokens, b->completion_tokens);
  EXPECT_EQ(st->clip_fraction, 0.0);    // ratio 1 on the first pass
  EXPECT_GT(st->logprob_gap_max, 0.0);  // the samples' -3 are not the model's
  const std::vector<double> after = completion_logprobs(dp, s);
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i].advantage > 0) {
      EXPECT_GT(after[i], before[i]) << "sample " << i;
    } else {
      EXPECT_LT(after[i], before[i]) << "sample " << i;
    }
  }
}

// The invariant DAPO's token-mean normalisation exists for: the loss and its gradients are the
// same whatever the micro-batching and however many trainer ranks (DDP or FSDP) share the
// batch. The completions have different lengths, so normalising by each micro-batch's or each
// rank's own tokens would fail this. Tolerance: float summation in a different order, 1e-5 of
// the largest gradient (1e-6 relative for the loss). The router's load-balancing loss is left
// out: it is a function of the tokens one forward pass routes, so it is computed per
// micro-batch, as Megatron does (with it the gradients differ by 0.5% of the largest here).
TEST(PolicyStep, LossAndGradientsDoNotDependOnMicroBatchesOrRanks) {
  model::ModelConfig c = tiny();
  c.aux_loss_alpha = 0;
  const std::vector<Sample> s = samples_of(c, 8);
  Result<PolicyBatch> b = make_policy_batch(s, 16);
  ASSERT_TRUE(b.ok());
  const model::ParamLayout layout(c);
  std::vector<float> w(size_t(layout.total()));
  model::init_params(c, layout, 5, w.data());
  struct Got {
    double loss = 0;
    int64_t tokens = 0;
    std::vector<float> grads;
  };
  auto run = [&](int ranks, parallel::DpMode mode, int micro_batches) {
    Got got;
    parallel::testing::run_data_parallel(
        ranks, c, {.dp_mode = mode, .micro_batches = micro_batches},
        [&](parallel::DataParallel& dp) {
          dp.set_params(w.data());
          Result<PolicyStats> st = policy_gradients(dp, *b, {}, {});
          ASSERT_TRUE(st.ok()) << st.status().to_string();
          std::vector<float> g(size_t(layout.total()));
          ASSERT_TRUE(dp.gather_grads(g.data()).ok());
          if (dp.rank() == 0) got = {st->loss, st->tokens, std::move(g)};
        });
    return got;
  };
  const Got one = run(1, parallel::DpMode::kDdp, 1);
  ASSERT_EQ(one.tokens, b->completion_tokens);
  double scale = 0;
  for (float g : one.grads) scale = std::max(scale, double(std::fabs(g)));
  ASSERT_GT(scale, 0.0);
  struct Case {
    int ranks;
    parallel::DpMode mode;
    int micro_batches;
  };
  for (const Case k : {Case{1, parallel::DpMode::kDdp, 2}, Case{1, parallel::DpMode::kDdp, 8},
                       Case{2, parallel::DpMode::kDdp, 1}, Case{2, parallel::DpMode::kDdp, 4},
                       Case{2, parallel::DpMode::kFsdp, 2}}) {
    const Got got = run(k.ranks, k.mode, k.micro_batches);
    const std::string where = std::to_string(k.ranks) + " ranks, " +
                              std::to_string(k.micro_batches) + " micro-batches" +
                              (k.mode == parallel::DpMode::kFsdp ? ", fsdp" : "");
    EXPECT_NEAR(got.loss, one.loss, 1e-6 * std::fabs(one.loss)) << where;
    EXPECT_EQ(got.tokens, one.tokens) << where;
    ASSERT_EQ(got.grads.size(), one.grads.size()) << where;
    double worst = 0;
    for (size_t i = 0; i < got.grads.size(); ++i)
      worst = std::max(worst, double(std::fabs(got.grads[i] - one.grads[i])));
    EXPECT_LE(worst, 1e-5 * scale) << where << ": largest gradient " << scale;
  }
}

TEST(KlToken, IsSchulmansK3AndItsDerivative) {
  EXPECT_EQ(kl_token(-1.3, -1.3, 4, 0.1).kl, 0.0);  // the reference itself: no penalty, no pull
  EXPECT_EQ(kl_token(-1.3, -1.3, 4, 0.1).coef, 0.0);
  for (const double logp : {-3.0, -1.0, -0.2}) {
    for (const double ref : {-2.5, -0.5}) {
      const KlTerm t = kl_token(logp, ref, 4, 0.1);
      EXPECT_NEAR(t.kl, std::exp(ref - logp) - (ref - logp) - 1, 1e-12);
      EXPECT_GE(t.kl, 0.0);
      EXPECT_NEAR(t.loss, 0.1 * t.kl / 4, 1e-12);
      // coef is -d loss / d logp: central difference.
      const double h = 1e-6;
      const double d =
          (kl_token(logp + h, ref, 4, 0.1).loss - kl_token(logp - h, ref, 4, 0.1).loss) / (2 * h);
      EXPECT_NEAR(t.coef, -d, 1e-7);
    }
  }
}

// With no advantage at all, a KL term alone pulls the policy towards the reference: tokens the
// reference finds likelier become likelier.
TEST(PolicyStep, TheKlTermPullsTowardsTheReference) {
  const model::ModelConfig c = tiny();
  parallel::DataParallel dp(c, {}, nullptr, nullptr);
  std::vector<float> w(size_t(dp.layout().total()));
  model::init_params(c, dp.layout(), 5, w.data());
  dp.set_params(w.data());
  std::vector<Sample> s = samples_of(c, 4);
  for (Sample& x : s) x.advantage = 0;
  const std::vector<double> before = completion_logprobs(dp, s);
  Result<PolicyBatch> b = make_policy_batch(s, 16);
  ASSERT_TRUE(b.ok());
  // Without reference log-probabilities a KL loss is refused, naming what is missing.
  Result<PolicyStats> refused = policy_step(dp, *b, {.lr = 3e-3}, {.kl_coef = 0.5});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("reference log-probabilities"), std::string::npos);
  Result<std::vector<double>> own = target_logprobs(dp, b->batch);
  ASSERT_TRUE(own.ok());
  b->logp_ref = *own;
  for (size_t i = 0; i < b->logp_ref.size(); ++i)
    if (b->batch.targets[i] != kernels::kIgnoreIndex) b->logp_ref[i] += 0.5;
  Result<PolicyStats> st = policy_step(dp, *b, {.lr = 3e-3}, {.kl_coef = 0.5});
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_NEAR(st->kl_mean, std::exp(0.5) - 0.5 - 1, 1e-4);
  const std::vector<double> after = completion_logprobs(dp, s);
  for (size_t i = 0; i < s.size(); ++i) EXPECT_GT(after[i], before[i]) << "sample " << i;
}

TEST(PolicyStep, BadSamplesAreNamed) {
  std::vector<Sample> s(2);
  s[0].prompt = {1, 2};
  s[0].completion = {3};
  s[0].logprobs = {-1};
  s[1].prompt = {1};
  s[1].completion = {3, 4};
  s[1].logprobs = {-1};
  Result<PolicyBatch> b = make_policy_batch(s, 8);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("sample 1: 1 logprobs for 2 tokens"), std::string::npos);
  s[1].logprobs = {-1, -1};
  // Sample 0 needs 2 positions: its prompt's two tokens, the second with the target 3.
  EXPECT_FALSE(make_policy_batch(s, 1).ok());
  EXPECT_TRUE(make_policy_batch(s, 2).ok());
}

// ---- routing replay (R3) ------------------------------------------------------------------

// Samples with routes that are not the trainer's own choice: distinct random experts for every
// fed token (the prompt, the completion but its last) in every MoE layer, -1 in a dense one.
std::vector<Sample> samples_with_routes(const model::ModelConfig& c, int n) {
  std::vector<Sample> s = samples_of(c, n);
  Rng rng(7);
  for (Sample& x : s) {
    const size_t fed = x.prompt.size() + x.completion.size() - 1;
    for (size_t t = 0; t < fed * size_t(c.num_layers); ++t) {
      if (c.dense_layer(int64_t(t % size_t(c.num_layers)))) {
        x.routes.insert(x.routes.end(), size_t(c.top_k), -1);
        continue;
      }
      std::vector<int32_t> experts(size_t(c.num_experts));
      std::iota(experts.begin(), experts.end(), 0);
      for (int64_t j = 0; j < c.top_k; ++j) {  // a partial Fisher-Yates shuffle
        std::swap(experts[size_t(j)], experts[size_t(j) + rng.below(uint64_t(c.num_experts - j))]);
        x.routes.push_back(experts[size_t(j)]);
      }
    }
  }
  return s;
}

// The trainer replays the rollout's experts for every token of every layer, and the share it
// reports as differing from its own router is that of random routes (most of them).
TEST(RoutingReplay, TheTrainerRoutesEveryTokenAsTheRolloutDid) {
  const model::ModelConfig c = tiny();
  parallel::DataParallel dp(c, {}, nullptr, nullptr);
  std::vector<float> w(size_t(dp.layout().total()));
  model::init_params(c, dp.layout(), 5, w.data());
  dp.set_params(w.data());
  const std::vector<Sample> s = samples_with_routes(c, 6);
  Result<PolicyBatch> b = make_policy_batch(s, 16, route_shape(c));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  std::vector<int32_t> used(b->routes.size(), -1);
  int64_t differ = 0;
  ASSERT_TRUE(
      parallel::compute_gradients(
          dp, b->batch,
          {.replay_routes = b->routes.data(), .routes_out = used.data(), .replay_differ = &differ})
          .ok());
  const size_t width = size_t(c.num_layers * c.top_k);
  int64_t fed = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const size_t row = i * 16 * width;
    EXPECT_TRUE(std::equal(s[i].routes.begin(), s[i].routes.end(), used.begin() + int64_t(row)))
        << "sample " << i;
    fed += int64_t(s[i].routes.size() / width) * c.num_layers;
  }
  EXPECT_GT(differ, fed / 4) << "random routes are mostly not the router's own";
  EXPECT_LE(differ, fed);
  Result<PolicyStats> st = policy_gradients(dp, *b, {}, {});
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_NEAR(st->replay_differ, double(differ) / double(fed), 1e-12);
}

// A model with dense layers (Qwen3-MoE's mlp_only_layers, here the first one) records -1 for
// them: the trainer takes such routes, replays the MoE layers', and counts the differing share
// over the MoE layers only. An expert named in a dense layer is a worker that lies.
TEST(RoutingReplay, ModelsWithDenseLayersReplayTheirMoeLayers) {
  model::ModelConfig c = tiny();
  c.dense_layers = {0};
  c.dense_ffn_dim = 96;
  ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
  parallel::DataParallel dp(c, {}, nullptr, nullptr);
  std::vector<float> w(size_t(dp.layout().total()));
  model::init_params(c, dp.layout(), 5, w.data());
  dp.set_params(w.data());
  const std::vector<Sample> s = samples_with_routes(c, 6);
  Result<PolicyBatch> b = make_policy_batch(s, 16, route_shape(c));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  std::vector<int32_t> used(b->routes.size(), -1);
  int64_t differ = 0;
  ASSERT_TRUE(
      parallel::compute_gradients(
          dp, b->batch,
          {.replay_routes = b->routes.data(), .routes_out = used.data(), .replay_differ = &differ})
          .ok());
  const size_t width = size_t(c.num_layers * c.top_k);
  int64_t fed = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_TRUE(
        std::equal(s[i].routes.begin(), s[i].routes.end(), used.begin() + int64_t(i * 16 * width)))
        << "sample " << i << ": every MoE layer runs the recorded experts, a dense layer none";
    fed += int64_t(s[i].routes.size() / width) * c.moe_layers();
  }
  EXPECT_GT(differ, fed / 4);
  EXPECT_LE(differ, fed);
  Result<PolicyStats> st = policy_gradients(dp, *b, {}, {});
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_NEAR(st->replay_differ, double(differ) / double(fed), 1e-12);

  std::vector<Sample> lying = s;
  lying[1].routes[size_t(c.num_layers * c.top_k)] = 0;  // token 1, layer 0
  Result<PolicyBatch> refused = make_policy_batch(lying, 16, route_shape(c));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "sample 1: routes: token 1, layer 0: expert 0 in a dense layer"),
            std::string::npos)
      << refused.status().message();
}

// A trainer with a capacity factor replays the rollout's drops: a slot the routes mark
// dropped (kernels::dropped_route) drops, and no other (the rollout's capacity decided, over
// its own passes); the step reports the share of the pass's slots, padding rows' included, and
// the record keeps it through rl_metrics.jsonl.
TEST(TokenDropping, ThePolicyStepReportsItsDropRateAndItsRecordKeepsIt) {
  for (const std::optional<double> factor : {std::optional<double>(), std::optional(0.5)}) {
    model::ModelConfig c = tiny();
    c.capacity_factor = factor;
    parallel::DataParallel dp(c, {}, nullptr, nullptr);
    std::vector<float> w(size_t(dp.layout().total()));
    model::init_params(c, dp.layout(), 5, w.data());
    dp.set_params(w.data());
    std::vector<Sample> samples = samples_with_routes(c, 6);
    int64_t marked = 0;
    for (Sample& x : samples) {
      for (size_t i = 0; i < x.routes.size(); i += 3, ++marked) {
        x.routes[i] = kernels::dropped_route(x.routes[i]);
      }
    }
    Result<PolicyBatch> b = make_policy_batch(samples, 16, route_shape(c));
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    Result<PolicyStats> st = policy_gradients(dp, *b, {}, {});
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    StepRecord r{.phase = "rl", .step = 1};
    r.stats = *st;
    Result<StepRecord> back = record_from_json(record_to_json(r), "a record");
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    if (!factor) {
      EXPECT_TRUE(std::isnan(st->drop_rate));
      EXPECT_FALSE(record_to_json(r).contains("drop_rate"));
      EXPECT_TRUE(std::isnan(back->stats.drop_rate));
      continue;
    }
    const int64_t slots = b->batch.batch * b->batch.seq * c.moe_layers() * c.top_k;
    EXPECT_NEAR(st->drop_rate, double(marked) / double(slots), 1e-12);
    EXPECT_EQ(back->stats.drop_rate, st->drop_rate);
  }
}

// With the routes fixed the loss is a smooth function of the router's weights, and the
// router's gradient under replay is its derivative: central differences on the router
// weights with the largest gradients agree within 2% (measured: 0.03% and 0.07%). A replay that cut
// the router out of the graph (gates as constants) gives zero there.
TEST(RoutingReplay, TheRouterKeepsItsGradient) {
  model::ModelConfig c = tiny();
  c.aux_loss_alpha = 0;  // the policy loss alone, which st.loss is
  c.z_loss_beta = 0;
  parallel::DataParallel dp(c, {}, nullptr, nullptr);
  std::vector<float> w(size_t(dp.layout().total()));
  model::init_params(c, dp.layout(), 5, w.data());
  Result<PolicyBatch> b = make_policy_batch(samples_with_routes(c, 6), 16, route_shape(c));
  ASSERT_TRUE(b.ok());
  auto loss_at = [&](const std::vector<float>& weights) {
    dp.set_params(weights.data());
    Result<PolicyStats> st = policy_gradients(dp, *b, {}, {});
    EXPECT_TRUE(st.ok()) << st.status().to_string();
    return st.ok() ? st->loss : NAN;
  };
  loss_at(w);
  const std::vector<float> g = gradients(dp);
  int checked = 0;
  for (const model::ParamInfo& p : dp.layout().params()) {
    if (!p.name.ends_with("router.weight")) continue;
    int64_t at = p.offset;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i)
      if (std::fabs(g[size_t(i)]) > std::fabs(g[size_t(at)])) at = i;
    ASSERT_GT(std::fabs(g[size_t(at)]), 0.0f) << p.name;
    constexpr float kStep = 1e-2f;
    std::vector<float> up = w, down = w;
    up[size_t(at)] += kStep;
    down[size_t(at)] -= kStep;
    const double numeric =
        (loss_at(up) - loss_at(down)) / (double(up[size_t(at)]) - down[size_t(at)]);
    std::printf("%s: numeric %.6g analytic %.6g\n", p.name.c_str(), numeric, double(g[size_t(at)]));
    EXPECT_NEAR(numeric, g[size_t(at)], 0.02 * std::fabs(g[size_t(at)])) << p.name;
    ++checked;
  }
  EXPECT_EQ(checked, c.num_layers);
}

// Routes from a worker are checked before anything trains on them.
TEST(RoutingReplay, RoutesThatCannotBeAreRefusedNamingTheToken) {
  const model::ModelConfig c = tiny();
  std::vector<Sample> s = samples_with_routes(c, 2);
  auto refused = [&](const std::vector<Sample>& x, const std::string& what) {
    Result<PolicyBatch> b = make_policy_batch(x, 16, route_shape(c));
    ASSERT_FALSE(b.ok()) << what;
    EXPECT_NE(b.status().message().find(what), std::string::npos) << b.status().message();
  };
  std::vector<Sample> bad = s;
  bad[1].routes.pop_back();
  refused(bad, "sample 1: routes: ");
  bad = s;
  bad[0].routes[size_t(2 * c.num_layers * c.top_k + c.top_k)] = int32_t(c.num_experts);
  refused(bad, "sample 0: routes: token 2, layer 1: expert " + std::to_string(c.num_experts) +
                   " outside [0, " + std::to_string(c.num_experts) + ")");
  bad = s;
  bad[0].routes[1] = bad[0].routes[0];
  refused(bad, "token 0, layer 0: expert " + std::to_string(bad[0].routes[0]) + " twice");
  bad = s;
  bad[1].routes.clear();  // some samples with routes, some without
  refused(bad, "sample 1: routes: 0 entries");
}

}  // namespace
}  // namespace wl::rl
