// Token dropping (ModelConfig::capacity_factor) through the whole model: a factor that drops
// nothing is the dropless path bit for bit, the shortcuts of a pass (gradient checkpointing,
// computing only the positions with a target) drop the same slots, and the drop rate falls as
// the factor rises. The dropping rule itself is kernels' GroupByExpert tests; the loss and
// gradients under it are held to PyTorch in tests/reference/check_numerics.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weightlift/core/random.h"
#include "weightlift/kernels/router.h"
#include "weightlift/model/expert_exchange.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/transformer.h"

namespace wl::model {
namespace {

struct Tokens {
  int64_t b = 4, t = 32;
  std::vector<int64_t> tokens, targets;
};

Tokens random_tokens(const ModelConfig& c, uint64_t seed) {
  Rng rng(seed);
  Tokens x;
  for (int64_t i = 0; i < x.b * x.t; ++i) {
    x.tokens.push_back(int64_t(rng.below(uint64_t(c.vocab_size))));
    x.targets.push_back(i % 5 == 2 ? -100 : int64_t(rng.below(uint64_t(c.vocab_size))));
  }
  return x;
}

struct Step {
  LossTerms loss;
  std::vector<float> grads;
};

Step step(const ModelConfig& c, const Tokens& x, StepOptions o = {}, bool subset = false,
          PassHooks* hooks = nullptr) {
  Transformer m(c);
  m.init(5);
  m.zero_grads();
  if (subset) o.targets = x.targets.data();
  StagePass pass(m.pass_model(), {0, m.units().head()}, x.tokens.data(), x.b, x.t, o, hooks);
  EXPECT_TRUE(pass.forward(nullptr, true).ok());
  Step s;
  s.loss = pass.loss(x.targets.data());
  EXPECT_TRUE(pass.backward(nullptr).ok());
  const float* g = m.grads().data<float>();
  s.grads.assign(g, g + m.layout().total());
  return s;
}

ModelConfig tiny_with(std::optional<double> factor) {
  ModelConfig c = *preset("tiny");
  c.z_loss_beta = 1e-3;
  c.capacity_factor = factor;
  return c;
}

TEST(TokenDropping, AFactorThatDropsNothingIsTheDroplessPathBitForBit) {
  // tiny routes each token to 2 distinct experts of 4: an expert gets at most one slot per
  // token, and factor 2 gives it 2 * N * 2 / 4 = N.
  const Tokens x = random_tokens(tiny_with({}), 1);
  const Step dropless = step(tiny_with({}), x);
  const Step roomy = step(tiny_with(2.0), x);
  EXPECT_EQ(roomy.loss.dropped, 0);
  EXPECT_EQ(roomy.loss.slots, 2 * x.b * x.t * 2);  // layers x tokens x top_k
  EXPECT_EQ(dropless.loss.dropped, 0);
  EXPECT_EQ(roomy.loss.ce, dropless.loss.ce);
  EXPECT_EQ(roomy.loss.aux, dropless.loss.aux);
  EXPECT_EQ(roomy.loss.z, dropless.loss.z);
  ASSERT_EQ(roomy.grads.size(), dropless.grads.size());
  for (size_t i = 0; i < roomy.grads.size(); ++i) {
    ASSERT_EQ(roomy.grads[i], dropless.grads[i]) << "element " << i;
  }
}

// An expert group of one rank that hands every exchange back, and counts what it was asked.
class Loopback final : public PassHooks, public ExpertExchange {
 public:
  ExpertExchange* expert_exchange() override { return this; }
  int ranks() const override { return 1; }
  int rank() const override { return 0; }
  Status exchange_counts(const int64_t* send, int64_t* recv, int64_t per_peer) override {
    ++count_rounds;
    std::copy(send, send + per_peer, recv);
    return ok_status();
  }
  Status exchange_rows(const float* send, std::span<const int64_t> send_rows, float* recv,
                       std::span<const int64_t> recv_rows, int64_t width) override {
    EXPECT_EQ(send_rows[0], recv_rows[0]);
    blocks.push_back(send_rows[0] * width);
    std::memcpy(recv, send, size_t(send_rows[0] * width) * 4);
    return ok_status();
  }
  int count_rounds = 0;
  std::vector<int64_t> blocks;  // floats per peer, each exchange
};

// Switch's fixed-size dispatch under expert parallelism: with a capacity, the rows go to their
// experts' ranks in one exchange of blocks whose size is fixed by the capacity (a header, then
// `capacity` rows per expert), with no round of counts first; the model computes what it
// computes without an exchange, bit for bit. Without a capacity the counts go first.
TEST(TokenDropping, ExpertParallelDispatchSendsFixedSizeBlocksUnderACapacity) {
  const ModelConfig c = tiny_with(1.0);
  const Tokens x = random_tokens(c, 4);
  const Step alone = step(c, x);
  Loopback fixed;
  const Step exchanged = step(c, x, {}, false, &fixed);
  EXPECT_GT(alone.loss.dropped, 0);
  EXPECT_EQ(exchanged.loss.ce, alone.loss.ce);
  EXPECT_EQ(exchanged.loss.dropped, alone.loss.dropped);
  EXPECT_TRUE(exchanged.grads == alone.grads);
  EXPECT_EQ(fixed.count_rounds, 0);
  const int64_t capacity = kernels::expert_capacity(1.0, x.b * x.t, c.top_k, c.num_experts);
  const int64_t block = 2 * (1 + c.num_experts) + c.num_experts * capacity * c.hidden_size;
  // Forward: each layer's dispatch (fixed) and return; backward: the gradients there and back.
  ASSERT_EQ(fixed.blocks.size(), size_t(4 * c.num_layers));
  EXPECT_EQ(fixed.blocks[0], block);
  EXPECT_EQ(fixed.blocks[2], block);

  Loopback counted;
  const Step dropless = step(tiny_with({}), x, {}, false, &counted);
  EXPECT_EQ(counted.count_rounds, c.num_layers);
  EXPECT_TRUE(dropless.grads == step(tiny_with({}), x).grads);
}

TEST(TokenDropping, DroppingChangesTheLossAndTheGradientsOfTheDroppedTokens) {
  const Tokens x = random_tokens(tiny_with({}), 2);
  const Step dropless = step(tiny_with({}), x);
  const Step tight = step(tiny_with(0.75), x);
  EXPECT_GT(tight.loss.dropped, 0);
  EXPECT_NE(tight.loss.ce, dropless.loss.ce);
  EXPECT_TRUE(std::isfinite(tight.loss.aux));
  size_t differ = 0;
  for (size_t i = 0; i < tight.grads.size(); ++i) differ += tight.grads[i] != dropless.grads[i];
  EXPECT_GT(differ, tight.grads.size() / 4);
}

TEST(TokenDropping, CheckpointingAndHeadRowsDropTheSameSlots) {
  const ModelConfig c = tiny_with(0.75);
  const Tokens x = random_tokens(c, 3);
  const Step plain = step(c, x);
  ASSERT_GT(plain.loss.dropped, 0);
  const Step recomputed = step(c, x, {.checkpointing = true});
  EXPECT_EQ(recomputed.loss.dropped, plain.loss.dropped);
  EXPECT_EQ(recomputed.loss.ce, plain.loss.ce);
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    ASSERT_EQ(recomputed.grads[i], plain.grads[i]) << "checkpointing, element " << i;
  }
  // The last block runs only the tokens with a target; the others still take their places in
  // its experts' capacity, so the kept tokens lose the same slots.
  const Step subset = step(c, x, {}, /*subset=*/true);
  EXPECT_EQ(subset.loss.dropped, plain.loss.dropped);
  EXPECT_EQ(subset.loss.aux, plain.loss.aux);
  EXPECT_NEAR(subset.loss.ce, plain.loss.ce, 1e-6 * std::fabs(plain.loss.ce));
  float scale = 0;
  for (float v : plain.grads) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    ASSERT_NEAR(subset.grads[i], plain.grads[i], 1e-5f * scale) << "head rows, element " << i;
  }
}

// Routing replay of a pass that dropped (R3, as the RL trainer replays a rollout): the routes
// it records mark its drops (kernels::dropped_route), and a pass replaying them drops exactly
// those slots, whatever its own capacity would have done. Replayed into the same tokens, it is
// the recording pass bit for bit; replayed into a dropless model too (the drops come with the
// routes); a pass of its own on half the tokens drops other slots, which replay corrects.
TEST(TokenDropping, ReplayedRoutesCarryTheirDropsAndArePlayedBackExactly) {
  const ModelConfig c = tiny_with(0.75);
  const Tokens x = random_tokens(c, 4);
  const int64_t width = c.num_layers * c.top_k;
  std::vector<int32_t> routes(size_t(x.b * x.t * width), -1);
  const Step recorded = step(c, x, {.routes_out = routes.data()});
  ASSERT_GT(recorded.loss.dropped, 0);
  int64_t marked = 0;
  for (int32_t r : routes) {
    ASSERT_NE(r, -1) << "every slot recorded";
    marked += kernels::route_dropped(r);
  }
  EXPECT_EQ(marked, recorded.loss.dropped);
  for (const std::optional<double> factor :
       {std::optional<double>(0.75), std::optional<double>()}) {
    int64_t differ = 0;
    const Step replayed =
        step(tiny_with(factor), x, {.replay_routes = routes.data(), .replay_differ = &differ});
    EXPECT_EQ(differ, 0);
    EXPECT_EQ(replayed.loss.dropped, recorded.loss.dropped);
    EXPECT_EQ(replayed.loss.ce, recorded.loss.ce);
    for (size_t i = 0; i < recorded.grads.size(); ++i) {
      ASSERT_EQ(replayed.grads[i], recorded.grads[i]) << "element " << i;
    }
  }
  // The first two rows alone, on their own: the capacity is over half the tokens, so other
  // slots drop; replaying the whole pass's routes drops what it dropped.
  Tokens half = x;
  half.b = 2;
  half.tokens.resize(size_t(half.b * half.t));
  half.targets.resize(size_t(half.b * half.t));
  std::vector<int32_t> own(size_t(half.b * half.t * width), -1);
  step(c, half, {.routes_out = own.data()});
  EXPECT_FALSE(std::equal(own.begin(), own.end(), routes.begin())) << "the same drops: no test";
  std::vector<int32_t> again(own.size(), -1);
  step(c, half, {.replay_routes = routes.data(), .routes_out = again.data()});
  EXPECT_TRUE(std::equal(again.begin(), again.end(), routes.begin()));
}

TEST(TokenDropping, TheDropRateFallsAsTheFactorRises) {
  const Tokens x = random_tokens(tiny_with({}), 4);
  double last = 1;
  for (double factor : {0.25, 0.5, 0.75, 1.0, 1.5, 2.0}) {
    const Step s = step(tiny_with(factor), x);
    const double rate = double(s.loss.dropped) / double(s.loss.slots);
    EXPECT_LE(rate, last) << "factor " << factor;
    if (factor <= 0.5) {
      EXPECT_GE(rate, 0.5 - 0.01) << "factor " << factor;  // half the room, or less
    }
    last = rate;
  }
  EXPECT_EQ(last, 0.0);
}

}  // namespace
}  // namespace wl::model
