// Data-parallel training as real processes of the real command (`weightlift train`, started as
// a launcher would start it: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): a rank that dies
// mid-run (SIGKILL, chosen by --die-at-step so that the moment is known, not slept for) makes
// every other rank exit with one clear line naming a peer that is gone, long before the
// collective timeout, and at least one of them names the rank that died (the others may see
// a survivor leave first and name it: agreeing on the first casualty is the fault layer's
// job); the job then resumes from its last checkpoint and finishes. One test per layout
// family.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"
#include "train_ranks.h"
#include "weightlift/model/config.h"

namespace wl::parallel {
namespace {

using namespace std::chrono_literals;
using wl::testing::Child;
using wl::testing::free_port;
using wl::testing::reap;
using wl::testing::wait_exit;

const std::string kWeightlift = wl::testing::beside_binary(WL_WEIGHTLIFT_BINARY);
constexpr int kRanks = 3;

std::vector<Child> start_job(const std::vector<std::string>& args) {
  const int port = free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<std::string> argv = {kWeightlift, "--threads", "1", "train"};
    argv.insert(argv.end(), args.begin(), args.end());
    ranks.push_back(wl::testing::spawn_child(argv, {{"RANK", std::to_string(r)},
                                                    {"WORLD_SIZE", std::to_string(kRanks)},
                                                    {"MASTER_ADDR", "127.0.0.1"},
                                                    {"MASTER_PORT", std::to_string(port)},
                                                    {"WEIGHTLIFT_JOB_TOKEN", "tok"}}));
  }
  return ranks;
}

class KilledRank : public ::testing::TestWithParam<const char*> {};

TEST_P(KilledRank, TheOthersNameItAndTheJobResumes) {
  const std::string corpus = testing::make_corpus();
  const std::string out = testing::fresh_dir("run");
  std::vector<std::string> common = {"--corpus",
                                     corpus,
                                     "--batch",
                                     "6",
                                     "--seq",
                                     "32",
                                     "--steps",
                                     "8",
                                     "--out",
                                     out,
                                     "--eval-every",
                                     "0",
                                     "--checkpoint-every",
                                     "2",
                                     "--timeout",
                                     "30",
                                     "--quiet"};
  model::ModelConfig c = *model::preset("tiny");
  const std::string config = testing::fresh_dir("config") + "/config.json";
  if (std::string(GetParam()).starts_with("pp")) {
    // Three stages of a three-layer model, one rank each: the middle one dies. pp runs the
    // default zero-bubble order, whose stages send their input gradients before their weight
    // gradients run; pp_1f1b the one-forward-one-backward order.
    c.num_layers = 3;
    ASSERT_TRUE(model::save_config(c, config).ok());
    common.insert(common.end(), {"--config", config, "--pp", "3", "--micro-batches", "3"});
    if (std::string(GetParam()) == "pp_1f1b")
      common.insert(common.end(), {"--pp-schedule", "1f1b"});
  } else if (std::string(GetParam()) == "ep") {
    // Three ranks run one expert each for every rank's tokens: one dies, and the others
    // learn of it in the router's sum or an exchange, whichever they reach first.
    c.num_experts = 3;
    ASSERT_TRUE(model::save_config(c, config).ok());
    common.insert(common.end(), {"--config", config, "--ep", "3"});
  } else if (std::string(GetParam()) == "tp") {
    // Three ranks hold a head and a third of every expert's ffn rows each: one dies, and the
    // others learn of it in the sum after o_proj.
    c.num_heads = 3;
    c.ffn_dim = 96;
    ASSERT_TRUE(model::save_config(c, config).ok());
    common.insert(common.end(), {"--config", config, "--tp", "3"});
  } else {
    common.insert(common.end(), {"--preset", "tiny", "--dp-mode", GetParam()});
  }
  std::vector<std::string> doomed = common;
  doomed.insert(doomed.end(), {"--die-at-step", "3", "--die-rank", "1"});
  std::vector<Child> job = start_job(doomed);
  const auto started = std::chrono::steady_clock::now();
  const auto bound = comm::deadline_after(20s);  // the collectives' own timeout is 30 s
  EXPECT_EQ(wait_exit(job[1], bound), 128 + SIGKILL) << job[1].output;
  int named_the_dead = 0;
  for (int r : {0, 2}) {
    EXPECT_EQ(wait_exit(job[size_t(r)], bound), 1) << "rank " << r << ": " << job[size_t(r)].output;
    // The command's one line: a peer died, and which.
    const std::string& said = job[size_t(r)].output;
    EXPECT_NE(said.find("weightlift train: Unavailable: "), std::string::npos) << said;
    EXPECT_NE(said.find("the peer died or is unreachable"), std::string::npos) << said;
    named_the_dead += said.find("connection to rank 1 failed") != std::string::npos;
  }
  EXPECT_GE(named_the_dead, 1) << job[0].output << job[2].output;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_LT(seconds, 20.0);
  for (Child& c : job) reap(c);
  // The last checkpoint is step 2's, whole; the job resumes there and runs to the end.
  ASSERT_TRUE(std::filesystem::exists(out + "/checkpoint-2/state.json"));
  std::vector<std::string> again = common;
  again.insert(again.end(), {"--resume", out + "/checkpoint-2"});
  std::vector<Child> resumed = start_job(again);
  for (Child& c : resumed) {
    EXPECT_EQ(wait_exit(c, comm::deadline_after(60s)), 0) << c.output;
    reap(c);
  }
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint-8/state.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
}

INSTANTIATE_TEST_SUITE_P(Layouts, KilledRank,
                         ::testing::Values("ddp", "zero2", "fsdp", "pp", "pp_1f1b", "ep", "tp"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace wl::parallel
