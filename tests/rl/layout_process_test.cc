// One RL job on every trainer layout against every rollout layout, as real processes: the
// trainer as DDP 2, FSDP 2, two pipeline stages, two expert-parallel ranks or two
// tensor-parallel ranks; one rollout worker of one rank, of two TP ranks or of two EP ranks.
// Each gives the one-rank job's greedy held-out answers (the same accuracy at every
// evaluation), the same sampled tokens in its first RL step (the same rewards and token
// counts), and the same first-step log-probabilities within the drift below (the loss, the
// sampler's gap and importance weights, which a misplaced weight would move by its scale).
#include "process_fixture.h"

namespace wl::rl {
namespace {

using namespace process_testing;  // NOLINT: the fixture is what these tests are written in

// Under a sanitizer the trainer layouts run against the one-rank rollout only: the other
// rollout layouts bring no thread or memory path of their own (their tests are
// process_test.cc's), and each instance is six jobs (about 40 s under ThreadSanitizer). The
// release build runs the whole matrix.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderSanitizer = true;
#else
constexpr bool kUnderSanitizer = false;
#endif

// Layouts differ from the one-rank job by f32 reassociation (and, with two data-parallel
// ranks, the router's balancing loss taken over each rank's rows), which the warm start's 40
// AdamW steps turn into a drift of the weights: an element whose gradient is near zero moves
// by up to the learning rate either way. At the first RL step the loss and the mean
// |log p_trainer - log p_sampler| differ from the one-rank job's by at most 2.7e-5 and 4.5e-5
// (measured on every pair here, Zen 4); a weight out of place moves them by the weights'
// scale, and the sampler's gap inside each run is held to kBf16Gap besides.
inline constexpr double kFirstStepLoss = 3e-4, kFirstStepLogprobs = 3e-4;

struct Layout {
  const char* name;
  std::vector<std::string> flags;
  int ranks;  // processes of this side
};

const Layout kTrainers[] = {
    {"ddp", {"--trainers", "2", "--trainer-dp-mode", "ddp"}, 2},
    {"fsdp", {"--trainers", "2", "--trainer-dp-mode", "fsdp"}, 2},
    {"pp", {"--trainers", "2", "--trainer-pp", "2"}, 2},
    {"ep", {"--trainers", "2", "--trainer-ep", "2"}, 2},
    {"tp", {"--trainers", "2", "--trainer-tp", "2"}, 2},
};

const Layout kRollouts[] = {
    {"rollout_tp1", {}, 1},
    {"rollout_tp2", {"--rollout-tp", "2"}, 2},
    {"rollout_ep2", {"--rollout-ep", "2"}, 2},
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

// The records up to and including the first RL step that trained.
std::vector<nlohmann::json> to_first_trained(const std::vector<nlohmann::json>& records) {
  std::vector<nlohmann::json> out;
  for (const nlohmann::json& r : records) {
    out.push_back(r);
    if (r["phase"] == "rl" && r["trained"].get<int64_t>() > 0) break;
  }
  return out;
}

class EveryTrainerLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(EveryTrainerLayout, SamplesAndScoresAsTheOneRankJob) {
  const Layout& rollout = GetParam();
  if (kUnderSanitizer && rollout.ranks > 1) {
    GTEST_SKIP() << "the release build runs this rollout layout (see the top of the file)";
  }
  const std::vector<nlohmann::json> one =
      to_first_trained(run_to_end(2, short_run({}), fresh_dir("one_rank")));
  ASSERT_FALSE(one.empty());
  ASSERT_EQ(one.back()["phase"], "rl") << "no RL step trained: nothing to compare";
  for (const Layout& trainer : kTrainers) {
    SCOPED_TRACE(trainer.name);
    std::vector<std::string> flags = trainer.flags;
    flags.insert(flags.end(), rollout.flags.begin(), rollout.flags.end());
    const std::vector<nlohmann::json> got =
        to_first_trained(run_to_end(trainer.ranks + rollout.ranks, short_run(flags),
                                    fresh_dir(std::string(trainer.name) + "_" + rollout.name)));
    ASSERT_EQ(got.size(), one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      EXPECT_EQ(got[i].value("held_out_accuracy", -1.0), one[i].value("held_out_accuracy", -1.0))
          << "greedy held-out answers at record " << i;
    }
    const nlohmann::json &a = one.back(), &b = got.back();
    for (const char* k : {"step", "trained", "tokens", "reward_mean", "response_tokens"})
      EXPECT_EQ(b[k], a[k]) << k << " of the first trained RL step";
    const double loss = a["loss"];
    EXPECT_NEAR(b["loss"].get<double>(), loss, kFirstStepLoss);
    for (const char* k : {"logprob_gap_mean", "is_weight_mean"}) {
      EXPECT_NEAR(b[k].get<double>(), a[k].get<double>(), kFirstStepLogprobs) << k;
    }
    EXPECT_LT(b["logprob_gap_max"].get<double>(), kBf16Gap) << "the workers' weights";
    std::printf(
        "%s trainer, %s: first trained step's loss %.3g off, gap %.3g off\n", trainer.name,
        rollout.name, std::fabs(b["loss"].get<double>() - loss),
        std::fabs(b["logprob_gap_mean"].get<double>() - a["logprob_gap_mean"].get<double>()));
  }
}

INSTANTIATE_TEST_SUITE_P(RlProcesses, EveryTrainerLayout, ::testing::ValuesIn(kRollouts),
                         [](const ::testing::TestParamInfo<Layout>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
}  // namespace wl::rl
