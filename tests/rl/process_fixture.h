// What the RL process tests share (process_test.cc, process_fault_test.cc): the weightlift
// binary, a job of real processes started as a launcher starts it, its records, and the
// tolerances both hold runs to.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"
#include "support/scratch_dir.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/train/checkpoint_state.h"

namespace wl::rl::process_testing {

using namespace std::chrono_literals;
using wl::testing::Child;

inline const std::string kWeightlift = wl::testing::beside_binary(WL_WEIGHTLIFT_BINARY);
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderSanitizer = true;  // every step 5-35 times slower
#else
inline constexpr bool kUnderSanitizer = false;
#endif
// The largest |log p_trainer - log p_sampler| of a sampled token when the workers hold the
// trainer's weights in bf16 (8 bits of mantissa: each logit off by about 1e-2 of its size at
// most); measured at most 0.02 on `tiny`. A worker on other weights misses by far more.
inline constexpr double kBf16Gap = 0.05;
// Two trainer ranks against one: the warm start's losses differ by the router's balancing loss,
// taken over each rank's rows, and f32 reassociation.
inline constexpr double kTwoRanksLoss = 1e-5;  // measured 1.8e-6
// FSDP's finished policy against ZeRO-1's, each of two trainer ranks after the same run: the
// same sums of two ranks' gradients, so the same weights (measured 0), up to the optimizer's
// global norm, which the two add up in another order.
inline constexpr double kFsdpPolicy = 1e-5;
// A TP-2, EP-2 or PP-2 trainer's finished policy against one trainer rank's: measured 7.7e-6
// (TP), 9.9e-7 (EP) and 0 (PP: the same sums in the same order) in the release build, where
// both sample the same tokens; 1.7e-3 under ASan, where a sample came out otherwise in a later
// RL step. AdamW moves an element by a few lr (5e-4) per step at most, 4 RL steps here; a row
// gathered into the wrong place is off by the weights' scale (0.02, its largest elements
// several times that).
inline constexpr double kModelParallelPolicy = 1e-2;
// The share of token-layers a model-parallel trainer's own routers would have routed otherwise
// than the replayed routes, against one trainer rank's on the same samples: the same weights
// up to reassociation, so the same near-ties, but a near-tie decided the other way moves it
// by one token-layer in the step's few hundred.
inline constexpr double kReplayDiffer = 0.02;
// TP, EP or TP x EP rollout workers against one-rank ones: the same tokens sampled, so the same
// rewards; the trained losses differ by the sampler's log-probabilities, whose logits differ by
// f32 reassociation only (about 1e-6 of their scale). Relative to the loss, or to 0.1 when it is
// smaller (a GRPO loss of zero-mean advantages can come near 0, where a relative bound would
// be a bound on rounding). Measured at most 1.0e-7 absolute (TP 2 x EP 2 under ASan, on a loss
// of 0.0099).
inline constexpr double kTpWorkersLoss = 1e-5;
inline double workers_loss_bound(double loss) {
  return kTpWorkersLoss * std::max(std::fabs(loss), 0.1);
}

inline std::string fresh_dir(const std::string& name) {
  const std::string d = std::filesystem::temp_directory_path().string() + "/wl_rl_" +
                        std::to_string(getpid()) + "_" + name;
  std::filesystem::remove_all(d);
  wl::testing::remove_at_exit(d);
  return d;
}

// Rank r of a job of `ranks` whose store is on `port`, as a launcher starts it (a replacement
// is started the same way).
inline Child spawn_rank(int r, int ranks, int port, const std::vector<std::string>& args,
                        const std::vector<std::pair<std::string, std::string>>& more_env = {}) {
  std::vector<std::string> argv = {kWeightlift, "--threads", "1", "rl"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::pair<std::string, std::string>> env = {{"RANK", std::to_string(r)},
                                                          {"WORLD_SIZE", std::to_string(ranks)},
                                                          {"MASTER_ADDR", "127.0.0.1"},
                                                          {"MASTER_PORT", std::to_string(port)},
                                                          {"WEIGHTLIFT_JOB_TOKEN", "tok"}};
  env.insert(env.end(), more_env.begin(), more_env.end());
  return wl::testing::spawn_child(argv, env);
}

inline std::vector<Child> start_job(int ranks, const std::vector<std::string>& args) {
  const int port = wl::testing::free_port();
  std::vector<Child> job;
  for (int r = 0; r < ranks; ++r) job.push_back(spawn_rank(r, ranks, port, args));
  return job;
}

inline std::vector<nlohmann::json> read_records(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A job of `ranks` processes run to its end (every process must exit 0); its records.
inline std::vector<nlohmann::json> run_to_end(int ranks, const std::vector<std::string>& args,
                                              const std::string& out) {
  std::vector<std::string> a = args;
  a.insert(a.end(), {"--out", out});
  std::vector<Child> job = start_job(ranks, a);
  for (Child& c : job) {
    EXPECT_EQ(wl::testing::wait_exit(c, comm::deadline_after(120s)), 0) << c.output;
    wl::testing::reap(c);
  }
  return read_records(out + "/rl_metrics.jsonl");
}

// The largest difference between two weight files' elements (the same tensors in each);
// infinity, with a failure, when they do not hold the same tensors.
inline double largest_difference(const std::string& path_a, const std::string& path_b) {
  auto fa = SafetensorsFile::open(path_a), fb = SafetensorsFile::open(path_b);
  EXPECT_TRUE(fa.ok() && fb.ok()) << path_a << ", " << path_b;
  if (!fa.ok() || !fb.ok() || fa->tensors().size() != fb->tensors().size()) {
    ADD_FAILURE() << path_a << " and " << path_b << " hold different tensors";
    return std::numeric_limits<double>::infinity();
  }
  double apart = 0;
  for (const TensorInfo& t : fa->tensors()) {
    auto x = fa->get(t.name, DType::kF32, t.shape), y = fb->get(t.name, DType::kF32, t.shape);
    EXPECT_TRUE(x.ok() && y.ok()) << t.name;
    if (!x.ok() || !y.ok()) return std::numeric_limits<double>::infinity();
    for (int64_t k = 0; k < x->numel(); ++k)
      apart = std::max(apart, double(std::fabs(x->data<float>()[k] - y->data<float>()[k])));
  }
  return apart;
}

// A run of several trainer ranks (`b`) against the one-rank run of the same job (`a`): the
// warm start's losses within kTwoRanksLoss, and every trained RL step's sampling gap under
// kBf16Gap (the workers hold the trainer's weights) with its samples one version old at most
// (synchronous). What it saw, for the test to print.
struct AgainstOneRank {
  double worst_warm_start = 0;  // relative
  double largest_gap = 0;
  int trained = 0;  // RL steps that trained
};
inline AgainstOneRank expect_trains_as_one_rank(const std::vector<nlohmann::json>& a,
                                                const std::vector<nlohmann::json>& b) {
  AgainstOneRank seen;
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (b[i]["phase"] == "sft") {
      const double x = a[i]["loss"], y = b[i]["loss"];
      EXPECT_NEAR(y, x, kTwoRanksLoss * std::fabs(x)) << "warm-start step " << b[i]["step"];
      seen.worst_warm_start = std::max(seen.worst_warm_start, std::fabs(y - x) / std::fabs(x));
      continue;
    }
    if (b[i]["trained"].get<int64_t>() == 0) continue;
    ++seen.trained;
    seen.largest_gap = std::max(seen.largest_gap, b[i]["logprob_gap_max"].get<double>());
    EXPECT_LT(b[i]["logprob_gap_max"].get<double>(), kBf16Gap) << b[i].dump();
    EXPECT_EQ(b[i]["staleness"], nlohmann::json::array({b[i]["trained"]})) << b[i].dump();
  }
  EXPECT_GT(seen.trained, 0) << "no RL step trained: the test checks nothing of the policy step";
  return seen;
}

// Arguments of a short run on `tiny` whose RL steps train (a well-formed wrong answer earns
// half a reward, so groups are rarely flat), and more.
inline std::vector<std::string> short_run(const std::vector<std::string>& more) {
  std::vector<std::string> a = {
      "--preset",        "tiny", "--task",          "add", "--difficulty", "1",
      "--sft-steps",     "40",   "--sft-target",    "1",   "--steps",      "4",
      "--eval-every",    "10",   "--prompts",       "4",   "--group",      "4",
      "--eval-problems", "16",   "--format-reward", "0.5", "--timeout",    "30"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// Steps enough for a run that ends only when its test has done what it does in it and asks
// the trainer to stop (stop_trainer): a run of a fixed length may end first on a fast machine.
inline constexpr int kUntilStopped = 1000000;

// The records rl_metrics.jsonl in `out` holds whole (the trainer may be writing the next).
inline size_t records_written(const std::string& out) {
  std::ifstream in(out + "/rl_metrics.jsonl");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  return size_t(std::count(text.begin(), text.end(), '\n'));
}

// Whether the run in `out` writes `more` records within 60 s; `talker`'s output is drained
// meanwhile (a full pipe would stop it).
inline bool steps_on(const std::string& out, int64_t more, Child& talker) {
  const size_t want = records_written(out) + size_t(more);
  const comm::Deadline deadline = comm::deadline_after(60s);
  while (records_written(out) < want) {
    if (comm::Clock::now() > deadline) return false;
    wl::testing::drain(talker);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// The pid of the job's rank `r` (processes.json in `out`), 0 if it is not there.
inline pid_t pid_of_rank(const std::string& out, int r) {
  for (const nlohmann::json& p : nlohmann::json::parse(std::ifstream(out + "/processes.json")))
    if (p["rank"] == r) return p["pid"].get<pid_t>();
  return 0;
}

// Every child handed to it reaped (killed first if it still runs) when the test ends, however
// it ends: a run that goes on until asked to stop must not outlive a failed assertion.
class ReapAtExit {
 public:
  ReapAtExit() = default;
  ReapAtExit(const ReapAtExit&) = delete;
  ReapAtExit& operator=(const ReapAtExit&) = delete;
  ~ReapAtExit() {
    for (Child* c : children_) wl::testing::reap(*c);
  }
  void add(Child& c) { children_.push_back(&c); }

 private:
  std::vector<Child*> children_;
};

// Asks the run in `out` to end after the step it is in (SIGTERM to the trainer's rank 0: the
// run keeps its records and writes its summary, and its workers are told to stop).
inline void stop_trainer(const std::string& out) {
  const pid_t trainer = pid_of_rank(out, 0);
  ASSERT_GT(trainer, 0);
  ASSERT_EQ(::kill(trainer, SIGTERM), 0);
}

inline std::vector<std::string> roles_of(const std::string& out) {
  std::vector<std::string> roles;
  for (const nlohmann::json& p : nlohmann::json::parse(std::ifstream(out + "/processes.json")))
    roles.push_back(p["role"]);
  return roles;
}

}  // namespace wl::rl::process_testing
