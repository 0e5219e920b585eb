// The RL loop as real processes of the real command (`weightlift rl`, started as a launcher
// starts it): a trainer and two rollout workers, weights through the p2p engine before every
// step; and a worker killed mid-run ends the job with one clear error, not a hang.
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"
#include "support/scratch_dir.h"
#include "weightlift/train/checkpoint_state.h"

namespace wl::rl {
namespace {

using namespace std::chrono_literals;
using wl::testing::Child;

const std::string kWeightlift = wl::testing::beside_binary(WL_WEIGHTLIFT_BINARY);
// The largest |log p_trainer - log p_sampler| of a sampled token when the workers hold the
// trainer's weights in bf16 (8 bits of mantissa: each logit off by about 1e-2 of its size at
// most); measured at most 0.02 on `tiny`. A worker on other weights misses by far more.
constexpr double kBf16Gap = 0.05;
// Two trainer ranks against one: the warm start's losses differ by the router's balancing loss,
// taken over each rank's rows, and f32 reassociation.
constexpr double kTwoRanksLoss = 1e-5;  // measured 1.8e-6
// TP-2 rollout workers against TP-1 ones: the same tokens sampled, so the same rewards; the
// trained losses differ by the sampler's log-probabilities, whose logits differ by f32
// reassociation only.
constexpr double kTpWorkersLoss = 1e-5;  // measured 9.9e-7

std::string fresh_dir(const std::string& name) {
  const std::string d = std::filesystem::temp_directory_path().string() + "/wl_rl_" +
                        std::to_string(getpid()) + "_" + name;
  std::filesystem::remove_all(d);
  wl::testing::remove_at_exit(d);
  return d;
}

// Rank r of a job of `ranks` whose store is on `port`, as a launcher starts it (a replacement
// is started the same way).
Child spawn_rank(int r, int ranks, int port, const std::vector<std::string>& args,
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

std::vector<Child> start_job(int ranks, const std::vector<std::string>& args) {
  const int port = wl::testing::free_port();
  std::vector<Child> job;
  for (int r = 0; r < ranks; ++r) job.push_back(spawn_rank(r, ranks, port, args));
  return job;
}

std::vector<nlohmann::json> read_records(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A job of `ranks` processes run to its end (every process must exit 0); its records.
std::vector<nlohmann::json> run_to_end(int ranks, const std::vector<std::string>& args,
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

// Arguments of a short run on `tiny` whose RL steps train (a well-formed wrong answer earns
// half a reward, so groups are rarely flat), and more.
std::vector<std::string> short_run(const std::vector<std::string>& more) {
  std::vector<std::string> a = {
      "--preset",        "tiny", "--task",          "add", "--difficulty", "1",
      "--sft-steps",     "40",   "--sft-target",    "1",   "--steps",      "4",
      "--eval-every",    "10",   "--prompts",       "4",   "--group",      "4",
      "--eval-problems", "16",   "--format-reward", "0.5", "--timeout",    "30"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<std::string> roles_of(const std::string& out) {
  std::vector<std::string> roles;
  for (const nlohmann::json& p : nlohmann::json::parse(std::ifstream(out + "/processes.json")))
    roles.push_back(p["role"]);
  return roles;
}

// The loop trains: a well-formed wrong answer earns half a reward, so groups are rarely flat,
// and the test asks for trained steps, not only records.
TEST(RlProcesses, TrainerAndTwoWorkersRunTheLoop) {
  const std::string out = fresh_dir("run");
  std::vector<Child> job =
      start_job(3, {"--preset",        "tiny", "--task",       "add", "--difficulty",    "2",
                    "--sft-steps",     "20",   "--sft-target", "1",   "--steps",         "4",
                    "--eval-every",    "10",   "--prompts",    "4",   "--group",         "4",
                    "--eval-problems", "16",   "--timeout",    "30",  "--format-reward", "0.5",
                    "--out",           out});
  for (Child& c : job) {
    EXPECT_EQ(wl::testing::wait_exit(c, comm::deadline_after(120s)), 0) << c.output;
    wl::testing::reap(c);
  }
  std::ifstream metrics(out + "/rl_metrics.jsonl");
  ASSERT_TRUE(metrics.good());
  int sft = 0, rl = 0, trained_steps = 0;
  uint64_t last_version = 0;
  bool last_trained = false;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["phase"] == "sft") {
      ++sft;
      continue;
    }
    ++rl;
    // Every step that trains makes a new version; the next step trains that one, on samples
    // from it (synchronous).
    const uint64_t version = j["version"].get<uint64_t>();
    if (rl > 1) {
      EXPECT_EQ(version, last_version + (last_trained ? 1 : 0)) << line;
    }
    last_version = version;
    last_trained = j["trained"].get<int64_t>() > 0;
    if (!last_trained) continue;  // every group was flat
    ++trained_steps;
    EXPECT_EQ(j["staleness"], nlohmann::json::array({j["trained"]})) << line;
    // The workers' bf16 weights give each token nearly the trainer's own log-probability.
    EXPECT_LT(j["logprob_gap_max"].get<double>(), kBf16Gap) << line;
    EXPECT_NEAR(j["is_weight_mean"].get<double>(), 1.0, 0.01) << line;
    EXPECT_EQ(j["clip_fraction"].get<double>(), 0.0) << line;  // one pass per batch
  }
  EXPECT_EQ(sft, 20);
  EXPECT_EQ(rl, 4);
  EXPECT_GT(trained_steps, 0) << "no RL step trained: the loop ran but learnt nothing";
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  EXPECT_EQ(summary["rollout_workers"], 2);
  EXPECT_EQ(summary["steps"], 4);
  for (const char* field :
       {"accuracy_before", "accuracy_after", "sync_ms_median", "step_ms_median", "sync_share"}) {
    EXPECT_TRUE(summary[field].is_number()) << field << " in " << summary.dump();
  }
  // Synchronous: every trained sample came from the weights it was trained against.
  if (!summary["max_staleness_trained"].is_null()) {  // null: nothing was trained on
    EXPECT_EQ(summary["max_staleness_trained"], 0);
  }
  EXPECT_EQ(summary["stale_samples_dropped"], 0);
  EXPECT_GT(summary["sync_share"].get<double>(), 0.0);
  EXPECT_LT(summary["sync_share"].get<double>(), 1.0);
  EXPECT_TRUE(summary["events"].is_array());
  for (const char* f : {"reward.svg", "processes.json", "config.json", "model.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(out + "/" + f)) << f;
  // The report stands alone: its plots are inline, nothing is fetched.
  std::ifstream report_file(out + "/report.html");
  const std::string report((std::istreambuf_iterator<char>(report_file)), {});
  EXPECT_NE(report.find("<svg"), std::string::npos);
  EXPECT_EQ(report.find("src="), std::string::npos);
  // The trained policy is the model `weightlift generate --run` reads.
  Child gen = wl::testing::spawn_child({kWeightlift, "generate", "--run", out, "--prompt",
                                        "12+3=", "--max-new-tokens", "4", "--temperature", "0"},
                                       {});
  EXPECT_EQ(wl::testing::wait_exit(gen, comm::deadline_after(60s)), 0) << gen.output;
  wl::testing::reap(gen);
}

// A user's problems and a user's reward: a JSONL dataset of one-digit sums (a prompt, an answer
// and a field only the reward reads) scored by a Python reward process, which sees every
// completion with its row (it logs the field it reads) and pays for right answers and, a
// little, for length, so that groups are not flat. The run trains on its rewards, the report
// splits out the reward process's time, and a reward process that crashes ends the job with an
// error that names the process and quotes its stderr.
TEST(RlProcesses, ADatasetAndAUsersRewardProcessRunTheLoop) {
  const std::string dir = fresh_dir("dataset");
  std::filesystem::create_directories(dir);
  {
    std::ofstream rows(dir + "/sums.jsonl");
    for (int a = 0; a < 10; ++a) {
      for (int b = 0; b < 10; ++b) {
        rows << nlohmann::json{{"prompt", std::to_string(a) + "+" + std::to_string(b) + "="},
                               {"answer", std::to_string(a + b)},
                               {"tag", "row-" + std::to_string(10 * a + b)}}
                    .dump()
             << "\n";
      }
    }
    std::ofstream(dir + "/reward.py")
        << "import json, sys\n"
           "log = open(sys.argv[1], 'a')\n"
           "for line in sys.stdin:\n"
           "    q = json.loads(line)\n"
           "    log.write(q['row']['tag'] + '\\n'); log.flush()\n"
           "    right = q['ended'] and q['completion'] == q['row']['answer']\n"
           "    r = (1.0 if right else 0.0) + 0.01 * len(q['completion'])\n"
           "    print(json.dumps({'reward': r, 'correct': right}), flush=True)\n";
    std::ofstream(dir + "/crash.py") << "import sys\n"
                                        "sys.stdin.readline()\n"
                                        "sys.stderr.write('reward model out of memory\\n')\n"
                                        "sys.exit(2)\n";
  }
  const std::vector<std::string> common = {
      "--preset",    "tiny", "--dataset",       dir + "/sums.jsonl",
      "--sft-steps", "20",   "--sft-target",    "1",
      "--steps",     "3",    "--prompts",       "4",
      "--group",     "4",    "--eval-problems", "8",
      "--timeout",   "30"};
  std::vector<std::string> args = common;
  const std::string log = dir + "/scored.txt";
  args.insert(args.end(), {"--reward-cmd", "/usr/bin/python3 " + dir + "/reward.py " + log});
  const std::string out = dir + "/run";
  const std::vector<nlohmann::json> records = run_to_end(2, args, out);
  int rl = 0;
  int64_t trained = 0;
  for (const nlohmann::json& j : records) {
    if (j["phase"] != "rl") continue;
    ++rl;
    EXPECT_TRUE(j["reward_s"].is_number()) << j.dump();
    trained += j["trained"].get<int64_t>();
  }
  EXPECT_EQ(rl, 3);
  EXPECT_GT(trained, 0);
  // Every RL sample (3 steps x 4 prompts x 4, more with resampling) and held-out answer went
  // through the process with its row.
  int64_t scored = 0;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    EXPECT_EQ(line.rfind("row-", 0), 0u) << line;
    ++scored;
  }
  EXPECT_GE(scored, 3 * 4 * 4);
  std::ifstream report_file(out + "/report.html");
  const std::string report((std::istreambuf_iterator<char>(report_file)), {});
  EXPECT_NE(report.find("reward process"), std::string::npos);

  // Through the launcher, as a user runs it: the trainer's error stops the job.
  std::vector<std::string> argv = {kWeightlift, "launch",    "-n", "2", "--",
                                   kWeightlift, "--threads", "1",  "rl"};
  argv.insert(argv.end(), common.begin(), common.end());
  argv.insert(argv.end(),
              {"--reward-cmd", "/usr/bin/python3 " + dir + "/crash.py", "--out", dir + "/crashed"});
  Child job = wl::testing::spawn_child(argv, {});
  EXPECT_EQ(wl::testing::wait_exit(job, comm::deadline_after(120s)), 1) << job.output;
  for (const char* f : {"reward process `/usr/bin/python3", "reward model out of memory",
                        "exited with status 2", "prompt '"}) {
    EXPECT_NE(job.output.find(f), std::string::npos) << job.output;
  }
  wl::testing::reap(job);
}

// Two trainer ranks (ZeRO-1) and two rollout workers: each trainer rank pushes its own shard
// of the weights, and the workers hold the whole model (every trained step's log-probabilities
// match the trainer's, which a stale or missing shard would not). The warm start's losses are
// the single trainer rank's (the router's balancing loss, taken over each rank's rows, makes
// the only difference), both ranks write their rows into the checkpoints, and a run resumed
// from one on two ranks writes the uninterrupted run's records step for step.
TEST(RlProcesses, TwoTrainerRanksPushTheirOwnShardsAndTrainAsOne) {
  const std::string one = fresh_dir("one_trainer"), two = fresh_dir("two_trainers"),
                    resumed = fresh_dir("two_trainers_resumed");
  const std::vector<std::string> two_ranks = {
      "--trainers", "2", "--trainer-dp-mode", "zero1", "--checkpoint-every", "2"};
  const std::vector<nlohmann::json> a = run_to_end(3, short_run({}), one),
                                    b = run_to_end(4, short_run(two_ranks), two);
  ASSERT_EQ(a.size(), b.size());
  int trained = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (b[i]["phase"] == "sft") {
      const double x = a[i]["loss"], y = b[i]["loss"];
      EXPECT_NEAR(y, x, kTwoRanksLoss * std::fabs(x)) << "warm-start step " << b[i]["step"];
      worst = std::max(worst, std::fabs(y - x) / std::fabs(x));
      continue;
    }
    if (b[i]["trained"].get<int64_t>() == 0) continue;
    ++trained;
    EXPECT_LT(b[i]["logprob_gap_max"].get<double>(), kBf16Gap) << b[i].dump();
    EXPECT_EQ(b[i]["staleness"], nlohmann::json::array({b[i]["trained"]})) << b[i].dump();
  }
  EXPECT_GT(trained, 0) << "no RL step trained: the test checks nothing of the policy step";
  std::printf("two trainer ranks: warm-start losses within %.2g of one rank's (relative)\n", worst);
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(two + "/summary.json"));
  EXPECT_EQ(summary["trainer_ranks"], 2);
  EXPECT_EQ(summary["rollout_workers"], 2);
  EXPECT_EQ(roles_of(two), (std::vector<std::string>{"trainer", "trainer-rank-1",
                                                     "rollout-worker-1", "rollout-worker-2"}));
  for (const char* f : {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(two + "/checkpoint-2/" + f)) << f;
  std::vector<std::string> resume = two_ranks;
  resume.insert(resume.end(), {"--resume", two + "/checkpoint-2"});
  const std::vector<nlohmann::json> c = run_to_end(4, short_run(resume), resumed);
  ASSERT_EQ(b.size(), c.size());
  for (size_t i = 0; i < b.size(); ++i) {
    for (const char* k : {"phase", "step", "version", "loss", "reward_mean", "tokens"})
      EXPECT_EQ(b[i].value(k, nlohmann::json()), c[i].value(k, nlohmann::json()))
          << k << " of record " << i;
  }
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// `--init-weights RUN` starts RL from a trained run's model (its config.json and
// model.safetensors), not from random weights: a run that neither warms up nor steps from
// the policy of a finished one evaluates it as that run did, and writes it back unchanged.
TEST(RlProcesses, ARunStartsFromATrainedRunsWeights) {
  const std::string trained = fresh_dir("trained"), again = fresh_dir("from_trained");
  // Warmed up until half the held-out problems are right (about 130 steps), so that the
  // accuracy it is evaluated at tells a trained policy from a random one.
  std::vector<std::string> warm;
  const std::vector<std::string> base = short_run({});
  for (size_t i = 0; i + 1 < base.size(); i += 2) {
    if (base[i] == "--sft-steps" || base[i] == "--sft-target" || base[i] == "--steps") continue;
    warm.insert(warm.end(), {base[i], base[i + 1]});
  }
  warm.insert(warm.end(), {"--sft-steps", "400", "--sft-target", "0.5", "--steps", "2"});
  run_to_end(3, warm, trained);
  // short_run's flags but --preset (the run's own config instead), with no warm start and no
  // RL step.
  std::vector<std::string> from;
  for (size_t i = 0; i + 1 < base.size(); i += 2) {
    if (base[i] == "--preset" || base[i] == "--sft-steps" || base[i] == "--steps") continue;
    from.insert(from.end(), {base[i], base[i + 1]});
  }
  from.insert(from.end(), {"--sft-steps", "0", "--steps", "0", "--init-weights", trained});
  run_to_end(3, from, again);
  const nlohmann::json a = nlohmann::json::parse(std::ifstream(trained + "/summary.json")),
                       b = nlohmann::json::parse(std::ifstream(again + "/summary.json"));
  EXPECT_GT(a["accuracy_after"].get<double>(), 0.0) << a.dump();
  EXPECT_EQ(b["sft_steps"], 0);
  EXPECT_EQ(b["accuracy_before"], a["accuracy_after"]) << a.dump() << "\n" << b.dump();
  EXPECT_EQ(b["preset"], trained);
  const std::string policy = file_bytes(trained + "/model.safetensors");
  ASSERT_FALSE(policy.empty());
  EXPECT_TRUE(file_bytes(again + "/model.safetensors") == policy)
      << "a run of no steps wrote another policy than the one it started from";
  EXPECT_TRUE(file_bytes(again + "/config.json") == file_bytes(trained + "/config.json"));
  // The same from the run's Hugging Face export (hf/: Mixtral's names and config).
  const std::string from_hf = fresh_dir("from_trained_hf");
  std::vector<std::string> hf_args(from.begin(), from.end() - 2);
  hf_args.insert(hf_args.end(), {"--model-dir", trained + "/hf"});
  run_to_end(3, hf_args, from_hf);
  const nlohmann::json c = nlohmann::json::parse(std::ifstream(from_hf + "/summary.json"));
  EXPECT_EQ(c["accuracy_before"], a["accuracy_after"]) << c.dump();
  EXPECT_TRUE(file_bytes(from_hf + "/model.safetensors") == policy)
      << "a run of no steps from hf/ wrote another policy than the run it was exported from";

  // A directory without a model, and --preset beside it, are refused before anything runs,
  // with the exit code of what was given wrong (2).
  Child bad = wl::testing::spawn_child(
      {kWeightlift, "rl", "--init-weights", again + "/no-such-run", "--out", again + "/x"}, {});
  EXPECT_EQ(wl::testing::wait_exit(bad, comm::deadline_after(30s)), 2) << bad.output;
  EXPECT_NE(bad.output.find("--init-weights " + again +
                            "/no-such-run: expected a trained run's "
                            "directory holding config.json and model.safetensors"),
            std::string::npos)
      << bad.output;
  wl::testing::reap(bad);
  Child both = wl::testing::spawn_child(
      {kWeightlift, "rl", "--preset", "tiny", "--init-weights", trained, "--out", again + "/y"},
      {});
  EXPECT_EQ(wl::testing::wait_exit(both, comm::deadline_after(30s)), 2) << both.output;
  EXPECT_NE(both.output.find("excludes"), std::string::npos) << both.output;
  wl::testing::reap(both);
}

// Rollout workers of two TP ranks each (two processes, each holding and computing with its
// slices of the weights, received straight from the trainer) sample what one-rank workers
// sample: the same tokens, so the same rewards and nearly the same losses (the logits differ
// by f32 reassociation only). Two trainer ranks pushing to them run too.
TEST(RlProcesses, RolloutWorkersOfTwoTpRanksSampleAsOneRankWorkers) {
  const std::string one = fresh_dir("tp1_workers"), two = fresh_dir("tp2_workers"),
                    both = fresh_dir("tp2_workers_two_trainers");
  const std::vector<nlohmann::json> a = run_to_end(3, short_run({}), one),
                                    b = run_to_end(5, short_run({"--rollout-tp", "2"}), two);
  ASSERT_EQ(a.size(), b.size());
  int trained = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i]["phase"] == "sft") continue;
    trained += a[i]["trained"].get<int64_t>() > 0;
    for (const char* k : {"trained", "reward_mean", "tokens", "version"})
      EXPECT_EQ(a[i][k], b[i][k]) << k << " of RL step " << a[i]["step"];
    const double x = a[i]["loss"], y = b[i]["loss"], scale = std::max(std::fabs(x), 1e-3);
    EXPECT_NEAR(y, x, kTpWorkersLoss * scale) << "RL step " << a[i]["step"];
    worst = std::max(worst, std::fabs(y - x) / scale);
  }
  EXPECT_GT(trained, 0) << "no RL step trained";
  std::printf("TP-2 workers: RL losses within %.2g of TP-1 workers' (relative)\n", worst);
  EXPECT_EQ(roles_of(two),
            (std::vector<std::string>{"trainer", "rollout-worker-1-tp-rank-0",
                                      "rollout-worker-1-tp-rank-1", "rollout-worker-2-tp-rank-0",
                                      "rollout-worker-2-tp-rank-1"}));
  for (const nlohmann::json& r :
       run_to_end(6, short_run({"--rollout-tp", "2", "--trainers", "2"}), both)) {
    if (r["phase"] == "rl" && r["trained"].get<int64_t>() > 0) {
      EXPECT_LT(r["logprob_gap_max"].get<double>(), kBf16Gap) << r.dump();
    }
  }
}

// fp8 sync: the workers hold e4m3 weights with a scale per 128x128 block; the loop runs and
// the trainer/rollout mismatch stays small on average (the importance weights correct it).
// The run's settings from a TOML file (--run-config), one of them overridden on the command
// line: the file's values reach the run (fp8 sync, the task, the step count) and the command
// line wins (group 4, not the file's 2).
TEST(RlProcesses, Fp8WeightsReachTheWorkers) {
  const std::string out = fresh_dir("fp8");
  const std::string config = out + ".toml";
  wl::testing::remove_at_exit(config);
  std::ofstream(config) << "preset = \"tiny\"\ntask = \"sort\"\ndifficulty = 2\n"
                           "sft-steps = 20\nsft-target = 1\nsteps = 4\nprompts = 4\n"
                           "group = 2\neval-problems = 8\nno-dynamic-sampling = true\n"
                           "sync-dtype = \"fp8\"\nrouting-replay = true\ntimeout = 30\n";
  std::vector<Child> job = start_job(2, {"--run-config", config, "--group", "4", "--out", out});
  for (Child& c : job) {
    EXPECT_EQ(wl::testing::wait_exit(c, comm::deadline_after(120s)), 0) << c.output;
    wl::testing::reap(c);
  }
  int rl = 0;
  for (const nlohmann::json& j : read_records(out + "/rl_metrics.jsonl")) {
    if (j["phase"] != "rl") continue;
    ++rl;
    EXPECT_GT(j["logprob_gap_mean"].get<double>(), 0.0) << j.dump();  // fp8 is not f32
    EXPECT_LT(j["logprob_gap_mean"].get<double>(), 0.1) << j.dump();
    // Routing replay: the share of token-layers whose rollout experts (on fp8 weights) were
    // not the trainer's own choice; a few percent at most, most often none.
    EXPECT_GE(j["replay_differ"].get<double>(), 0.0) << j.dump();
    EXPECT_LT(j["replay_differ"].get<double>(), 0.2) << j.dump();
  }
  EXPECT_EQ(rl, 4);
  std::ifstream summary_file(out + "/summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  EXPECT_EQ(summary["task"], "sort");
  EXPECT_EQ(summary["group"], 4);
  EXPECT_EQ(summary["prompts_per_step"], 4);
  EXPECT_EQ(summary["routing_replay"], true);
}

// Asynchronous mode: generation of the next batch overlaps training, the weights go out every
// other step at eta 2, and the records show every trained sample within eta versions of the
// weights it was trained against, with staleness 1 and 2 both seen (so the run really was
// asynchronous).
TEST(RlProcesses, AsynchronousRunsNeverTrainOnSamplesOlderThanEta) {
  const std::string out = fresh_dir("async");
  std::vector<Child> job = start_job(2, {"--preset",
                                         "tiny",
                                         "--task",
                                         "sort",
                                         "--difficulty",
                                         "2",
                                         "--sft-steps",
                                         "10",
                                         "--sft-target",
                                         "1",
                                         "--steps",
                                         "9",
                                         "--eval-every",
                                         "4",
                                         "--prompts",
                                         "4",
                                         "--group",
                                         "4",
                                         "--eval-problems",
                                         "8",
                                         "--max-staleness",
                                         "2",
                                         "--no-dynamic-sampling",
                                         "--timeout",
                                         "30",
                                         "--out",
                                         out});
  for (Child& c : job) {
    EXPECT_EQ(wl::testing::wait_exit(c, comm::deadline_after(120s)), 0) << c.output;
    wl::testing::reap(c);
  }
  std::ifstream metrics(out + "/rl_metrics.jsonl");
  ASSERT_TRUE(metrics.good());
  std::vector<int64_t> seen(3, 0);
  int rl = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["phase"] != "rl") continue;
    ++rl;
    EXPECT_EQ(j["stale_dropped"], 0) << line;
    const auto staleness = j["staleness"].get<std::vector<int64_t>>();
    ASSERT_LE(staleness.size(), 3u) << line;
    int64_t trained = 0;
    for (size_t k = 0; k < staleness.size(); ++k) {
      seen[k] += staleness[k];
      trained += staleness[k];
    }
    EXPECT_EQ(trained, j["trained"].get<int64_t>()) << line;
  }
  EXPECT_EQ(rl, 9);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  EXPECT_EQ(summary["mode"], "asynchronous");
  EXPECT_EQ(summary["max_staleness_trained"], 2);
}

// The newest checkpoint-<step> in `dir`, or "".
std::string last_checkpoint(const std::string& dir) {
  std::string best;
  int64_t best_step = -1;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("checkpoint-", 0) != 0 || name.find(".tmp") != std::string::npos) continue;
    const int64_t step = std::stoll(name.substr(11));
    if (step > best_step) {
      best_step = step;
      best = e.path().string();
    }
  }
  return best;
}

// An asynchronous checkpoint (a copy of `from`) whose pending round names a token the model
// does not have is refused by a job started with `args` plus --resume, naming the sample and
// the token, before any step.
void expect_damaged_pending_refused(const std::string& from, std::vector<std::string> args) {
  const std::string damaged = fresh_dir("damaged_checkpoint");
  std::filesystem::copy(
      from, damaged,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  nlohmann::json state = nlohmann::json::parse(std::ifstream(damaged + "/rl_state.json"));
  ASSERT_TRUE(state.contains("pending")) << "an asynchronous checkpoint holds the next round";
  state["pending"]["samples"][1]["completion"][0] = 1 << 20;
  // Sealed again, as a writer would: the checksum passes and the field's own check speaks.
  std::ofstream(damaged + "/rl_state.json") << train::seal_state_text(state.dump(1) + "\n");
  args.insert(args.end(), {"--resume", damaged});
  std::vector<Child> job = start_job(3, args);
  EXPECT_EQ(wl::testing::wait_exit(job[0], comm::deadline_after(60s)), 1) << job[0].output;
  EXPECT_NE(job[0].output.find("pending: sample 1, token 0: 1048576"), std::string::npos)
      << job[0].output;
  for (Child& c : job) wl::testing::kill_and_reap(c);
}

// rl_state.json is checksummed as state.json is, and what it says is checked against itself:
// an edit is refused as such, and an edit sealed again is refused by the range checks (a
// negative step count, records that do not match the steps, an accuracy above 1).
void expect_edited_state_refused(const std::string& from, const std::vector<std::string>& args) {
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    bool reseal;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {"an edited record", [](nlohmann::json& j) { j["records"][0]["loss"] = 0.0; }, false,
       "changed after it was written"},
      {"a negative step count", [](nlohmann::json& j) { j["rl_steps"] = -5; }, true, "rl_steps"},
      {"an absurd step count", [](nlohmann::json& j) { j["rl_steps"] = 1e18; }, true, "rl_steps"},
      {"records multiplied",
       [](nlohmann::json& j) {
         const nlohmann::json r = j["records"];
         for (const nlohmann::json& x : r) j["records"].push_back(x);
       },
       true, "records for"},
      {"an accuracy above 1", [](nlohmann::json& j) { j["held_out_before_rl"] = 7.0; }, true,
       "held_out_before_rl"},
  };
  for (const Case& c : cases) {
    const std::string damaged = fresh_dir("edited_state");
    std::filesystem::copy(from, damaged, std::filesystem::copy_options::recursive);
    nlohmann::json state = nlohmann::json::parse(std::ifstream(damaged + "/rl_state.json"));
    c.edit(state);
    const std::string text = state.dump(1) + "\n";
    std::ofstream(damaged + "/rl_state.json") << (c.reseal ? train::seal_state_text(text) : text);
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--resume", damaged, "--overwrite"});
    std::vector<Child> job = start_job(3, a);
    EXPECT_EQ(wl::testing::wait_exit(job[0], comm::deadline_after(60s)), 1)
        << c.what << job[0].output;
    EXPECT_NE(job[0].output.find(c.needle), std::string::npos) << c.what << ": " << job[0].output;
    for (Child& k : job) wl::testing::kill_and_reap(k);
  }
}

// The trainer is killed (SIGKILL) once it has written a checkpoint; a new job resumed from its
// last checkpoint writes, step for step, the records of a run that was never interrupted.
// Synchronous, and asynchronous (eta 1: the checkpoint holds the round generated for the
// next step, with its samples' versions).
class ResumedTrainer : public ::testing::TestWithParam<const char*> {};

TEST_P(ResumedTrainer, ContinuesTheUninterruptedCurve) {
  const std::vector<std::string> args = {"--preset",
                                         "tiny",
                                         "--task",
                                         "sort",
                                         "--difficulty",
                                         "2",
                                         "--sft-steps",
                                         "30",
                                         "--sft-target",
                                         "0.3",
                                         "--steps",
                                         "40",
                                         "--eval-every",
                                         "10",
                                         "--prompts",
                                         "4",
                                         "--group",
                                         "4",
                                         "--eval-problems",
                                         "16",
                                         "--checkpoint-every",
                                         "5",
                                         "--timeout",
                                         "20",
                                         "--max-staleness",
                                         GetParam()};
  auto with_out = [&](const std::string& out, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--out", out});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const std::string whole = fresh_dir("whole"), killed = fresh_dir("killed_trainer"),
                    resumed = fresh_dir("resumed");
  std::vector<Child> job = start_job(3, with_out(whole));
  for (Child& c : job) {
    ASSERT_EQ(wl::testing::wait_exit(c, comm::deadline_after(120s)), 0) << c.output;
    wl::testing::reap(c);
  }
  job = start_job(3, with_out(killed));
  const comm::Deadline deadline = comm::deadline_after(60s);
  while (last_checkpoint(killed).empty() && comm::Clock::now() < deadline)
    std::this_thread::sleep_for(2ms);
  wl::testing::kill_and_reap(job[0]);
  for (size_t r = 1; r < job.size(); ++r) wl::testing::kill_and_reap(job[r]);
  const std::string from = last_checkpoint(killed);
  ASSERT_FALSE(from.empty());
  job = start_job(3, with_out(resumed, {"--resume", from}));
  for (Child& c : job) {
    ASSERT_EQ(wl::testing::wait_exit(c, comm::deadline_after(120s)), 0) << c.output;
    wl::testing::reap(c);
  }
  const std::vector<nlohmann::json> a = read_records(whole + "/rl_metrics.jsonl"),
                                    b = read_records(resumed + "/rl_metrics.jsonl");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* k : {"phase", "step", "version", "loss", "reward_mean", "tokens",
                          "held_out_accuracy", "staleness"}) {
      EXPECT_EQ(a[i].value(k, nlohmann::json()), b[i].value(k, nlohmann::json()))
          << k << " of record " << i << " (resumed from " << from << ")";
    }
  }
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(resumed + "/summary.json"));
  EXPECT_NE(summary["events"].dump().find("resumed from"), std::string::npos) << summary.dump();
  // A resume that changes how the run samples is refused, naming the option.
  job = start_job(3, with_out(fresh_dir("changed"), {"--resume", from, "--temperature", "0.5"}));
  EXPECT_EQ(wl::testing::wait_exit(job[0], comm::deadline_after(60s)), 1) << job[0].output;
  EXPECT_NE(job[0].output.find("--temperature"), std::string::npos) << job[0].output;
  for (Child& c : job) wl::testing::kill_and_reap(c);
  if (std::string(GetParam()) == "1") {
    expect_damaged_pending_refused(from, with_out(fresh_dir("damaged_run")));
  } else {
    expect_edited_state_refused(from, with_out(fresh_dir("edited_run")));
  }
}

INSTANTIATE_TEST_SUITE_P(RlProcesses, ResumedTrainer, ::testing::Values("0", "1"),
                         [](const auto& info) {
                           return std::string(info.param) == "0" ? "Synchronous" : "Asynchronous";
                         });

// A run of `steps` RL steps on tiny's sort task, every group trained, long enough to kill a
// process in.
std::vector<std::string> run_to_kill_in(int steps, const std::string& out,
                                        const std::vector<std::string>& more = {}) {
  std::vector<std::string> a = {"--preset",
                                "tiny",
                                "--task",
                                "sort",
                                "--difficulty",
                                "2",
                                "--sft-steps",
                                "0",
                                "--steps",
                                std::to_string(steps),
                                "--eval-every",
                                "100",
                                "--prompts",
                                "4",
                                "--group",
                                "4",
                                "--eval-problems",
                                "8",
                                "--no-dynamic-sampling",
                                "--timeout",
                                "20",
                                "--out",
                                out};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// kill -9 of a rollout worker mid-run under `weightlift launch --restart-failed 1`: its share
// of the generation goes to the other worker, the launcher starts a replacement of the same
// rank, which heals the current weights (from its peer or the servers' copy) and rejoins; the
// run finishes, every trained sample came from the weights it was trained against, and
// processes.json names the replacement. That the replacement holds the trainer's weights is
// seen in what it samples: every step's largest log-probability gap between a sampled token's
// sampler and the trainer stays what bf16 weights give (kBf16Gap), where a worker on weights
// one version old or not healed at all would sample from another distribution.
TEST(RlProcesses, AKilledWorkerIsReplacedByTheLauncherAndHealsTheTrainersWeights) {
  const std::string out = fresh_dir("replaced");
  std::vector<std::string> argv = {kWeightlift,        "launch", "-n", "3",
                                   "--restart-failed", "1",      "--", kWeightlift,
                                   "--threads",        "1",      "rl"};
  for (const std::string& a : run_to_kill_in(300, out)) argv.push_back(a);
  Child launch = wl::testing::spawn_child(argv, {});
  ASSERT_TRUE(wl::testing::wait_for_output(launch, "rl [", comm::deadline_after(60s)))
      << launch.output;
  pid_t killed = 0;
  for (const nlohmann::json& p : nlohmann::json::parse(std::ifstream(out + "/processes.json")))
    if (p["rank"] == 2) killed = p["pid"].get<pid_t>();
  ASSERT_GT(killed, 0);
  // Some way into a step: the death may be found by a weight update or mid-generation.
  std::this_thread::sleep_for(std::chrono::milliseconds(50 + getpid() % 200));
  ASSERT_EQ(::kill(killed, SIGKILL), 0);
  EXPECT_EQ(wl::testing::wait_exit(launch, comm::deadline_after(120s)), 0) << launch.output;
  EXPECT_NE(launch.output.find("[launch] rank 2 "), std::string::npos) << launch.output;
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  const std::string events = summary["events"].dump();
  EXPECT_NE(events.find("rollout worker 2 lost"), std::string::npos) << events;
  // "rollout worker 2 rejoined (incarnation 2), healed to policy version V" at step S.
  int64_t rejoined_at = -1, healed_to = -1;
  const std::string rejoined =
      "rollout worker 2 rejoined (incarnation 2), healed to policy version ";
  for (const nlohmann::json& e : summary["events"]) {
    const std::string what = e["what"].get<std::string>();
    if (what.starts_with(rejoined)) {
      rejoined_at = e["step"].get<int64_t>();
      healed_to = std::stoll(what.substr(rejoined.size()));
    }
  }
  ASSERT_GE(rejoined_at, 1) << events;
  EXPECT_EQ(summary["max_staleness_trained"], 0);
  EXPECT_EQ(summary["stale_samples_dropped"], 0);
  int rl = 0, after_rejoin = 0;
  for (const nlohmann::json& j : read_records(out + "/rl_metrics.jsonl")) {
    if (j["phase"] != "rl") continue;
    ++rl;
    // No step lost samples to the death: every prompt was answered by someone.
    EXPECT_EQ(j["trained"], 16) << j.dump();
    EXPECT_EQ(j["staleness"], nlohmann::json::array({16})) << j.dump();
    EXPECT_LT(j["logprob_gap_max"].get<double>(), kBf16Gap) << j.dump();
    after_rejoin += j["step"].get<int64_t>() > rejoined_at;
    // It healed to the newest weights the fleet held as it joined: the ones pushed for the
    // step it joined in, or for the step before if it joined before that push.
    if (j["step"] == rejoined_at) {
      const int64_t version = j["version"].get<int64_t>();
      EXPECT_TRUE(healed_to == version || healed_to == version - 1)
          << "healed to " << healed_to << ", step " << rejoined_at << " trained " << version;
    }
  }
  EXPECT_EQ(rl, 300);
  EXPECT_GT(after_rejoin, 0) << "the replacement rejoined after the last step";
  const nlohmann::json processes = nlohmann::json::parse(std::ifstream(out + "/processes.json"));
  pid_t replacement = 0;
  for (const nlohmann::json& p : processes)
    if (p["rank"] == 2) replacement = p["pid"].get<pid_t>();
  EXPECT_GT(replacement, 0) << processes.dump();
  EXPECT_NE(replacement, killed) << processes.dump();
  wl::testing::reap(launch);
}

// A rollout worker frozen mid-run (SIGSTOP) never exits by itself: the trainer gives up on it
// at the timeout and says so to the launcher, which kills it and starts a replacement
// (--restart-failed); the run finishes and so does `weightlift launch`, with nothing left
// running.
TEST(RlProcesses, AFrozenWorkerIsKilledByTheLauncherAndTheJobEnds) {
  const std::string out = fresh_dir("frozen");
  std::vector<std::string> argv = {kWeightlift,        "launch", "-n", "3",
                                   "--restart-failed", "1",      "--", kWeightlift,
                                   "--threads",        "1",      "rl"};
  for (std::string a : run_to_kill_in(300, out)) argv.push_back(a == "20" ? "3" : a);  // --timeout
  Child launch = wl::testing::spawn_child(argv, {});
  ASSERT_TRUE(wl::testing::wait_for_output(launch, "rl [", comm::deadline_after(60s)))
      << launch.output;
  pid_t frozen = 0;
  for (const nlohmann::json& p : nlohmann::json::parse(std::ifstream(out + "/processes.json")))
    if (p["rank"] == 2) frozen = p["pid"].get<pid_t>();
  ASSERT_GT(frozen, 0);
  ASSERT_EQ(::kill(frozen, SIGSTOP), 0);
  EXPECT_EQ(wl::testing::wait_exit(launch, comm::deadline_after(120s)), 0) << launch.output;
  EXPECT_NE(launch.output.find("[launch] rank 2 was declared lost by the job; killing it"),
            std::string::npos)
      << launch.output;
  EXPECT_TRUE(::kill(frozen, 0) != 0 && errno == ESRCH) << "the frozen worker outlived the job";
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  const std::string events = summary["events"].dump();
  EXPECT_NE(events.find("rollout worker 2 lost"), std::string::npos) << events;
  wl::testing::reap(launch);
}

// Over TCP, as between hosts: two trainer ranks and one rollout worker. A replacement of the
// only worker has no peer to heal from: it reads its weights from both trainer ranks' servers'
// copies while rank 0 waits for it, and over TCP a one-sided read moves only while its target
// progresses, so it heals only if rank 1, waiting for rank 0's next order, lets its servers
// serve meanwhile. The trainer kills the worker itself right after step 5's weight update
// (--kill-worker-after-sync), the one moment the copy is certainly the version the worker
// held until the next update: the replacement must heal from it, every time.
TEST(RlProcesses, OverTcpAReplacementHealsFromEveryTrainerRanksServers) {
  const std::string out = fresh_dir("replaced_tcp");
  const int port = wl::testing::free_port();
  const std::vector<std::string> args =
      run_to_kill_in(12, out, {"--trainers", "2", "--kill-worker-after-sync", "5"});
  const std::vector<std::pair<std::string, std::string>> tcp = {{"UCX_TLS", "tcp"}};
  std::vector<Child> job;
  for (int r = 0; r < 3; ++r) job.push_back(spawn_rank(r, 3, port, args, tcp));
  EXPECT_EQ(wl::testing::wait_exit(job[2], comm::deadline_after(120s)), 128 + SIGKILL)
      << job[2].output << job[0].output;
  Child replacement = spawn_rank(2, 3, port, args, tcp);
  const std::string said = "rl: rejoin step 0: rollout worker 1 (incarnation 2) ";
  const std::string outcome =
      wl::testing::wait_for_line(replacement, said, comm::deadline_after(60s));
  EXPECT_NE(outcome.find(said + "healed version "), std::string::npos)
      << replacement.output << job[0].output;
  EXPECT_NE(outcome.find("from the servers' copy"), std::string::npos) << outcome;
  EXPECT_EQ(wl::testing::wait_exit(job[0], comm::deadline_after(120s)), 0) << job[0].output;
  for (Child* c : {&job[1], &replacement}) {
    EXPECT_EQ(wl::testing::wait_exit(*c, comm::deadline_after(30s)), 0) << c->output;
  }
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  EXPECT_NE(summary["events"].dump().find("rollout worker 1 rejoined (incarnation 2), healed to "
                                          "policy version"),
            std::string::npos)
      << summary["events"].dump();
  for (Child& c : job) wl::testing::reap(c);
  wl::testing::reap(replacement);
}

// kill -9 of one TP rank of a rollout worker of two: that worker is lost as a whole (its other
// rank ends with an error), the other worker takes its prompts, and the run finishes with no
// sample lost and none stale. A rank of a TP worker started again is refused: it cannot join
// its running peers. (On one host the engine's surviving rank may learn of its peer's death
// only at the timeout of the collective it waits in; the step then takes that long.)
TEST(RlProcesses, AWorkerOfTwoTpRanksThatLosesOneIsDroppedAndTheRunFinishes) {
  const std::string out = fresh_dir("tp_rank_killed");
  const int port = wl::testing::free_port();
  const std::vector<std::string> args = run_to_kill_in(150, out, {"--rollout-tp", "2"});
  std::vector<Child> job;
  for (int r = 0; r < 5; ++r) job.push_back(spawn_rank(r, 5, port, args));
  ASSERT_TRUE(wl::testing::wait_for_output(job[0], "rl [", comm::deadline_after(60s)))
      << job[0].output;
  std::this_thread::sleep_for(std::chrono::milliseconds(50 + getpid() % 200));
  wl::testing::kill_and_reap(job[4]);  // worker 2, TP rank 1
  std::vector<std::string> argv = {kWeightlift, "--threads", "1", "rl"};
  argv.insert(argv.end(), args.begin(), args.end());
  Child again = wl::testing::spawn_child(argv, {{"RANK", "4"},
                                                {"WORLD_SIZE", "5"},
                                                {"MASTER_ADDR", "127.0.0.1"},
                                                {"MASTER_PORT", std::to_string(port)},
                                                {"WEIGHTLIFT_JOB_TOKEN", "tok"},
                                                {"WEIGHTLIFT_RESTART", "1"}});
  EXPECT_EQ(wl::testing::wait_exit(again, comm::deadline_after(30s)), 1) << again.output;
  EXPECT_NE(again.output.find("cannot be replaced mid-run"), std::string::npos) << again.output;
  EXPECT_EQ(wl::testing::wait_exit(job[0], comm::deadline_after(120s)), 0) << job[0].output;
  for (int r : {1, 2}) {
    EXPECT_EQ(wl::testing::wait_exit(job[size_t(r)], comm::deadline_after(30s)), 0)
        << job[size_t(r)].output;
  }
  EXPECT_EQ(wl::testing::wait_exit(job[3], comm::deadline_after(60s)), 1) << job[3].output;
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  EXPECT_NE(summary["events"].dump().find("rollout worker 2 lost"), std::string::npos)
      << summary["events"].dump();
  EXPECT_EQ(summary["max_staleness_trained"], 0);
  int rl = 0;
  for (const nlohmann::json& j : read_records(out + "/rl_metrics.jsonl")) {
    if (j["phase"] != "rl") continue;
    ++rl;
    EXPECT_EQ(j["trained"], 16) << j.dump();
  }
  EXPECT_EQ(rl, 150);
  for (Child& c : job) wl::testing::reap(c);
  wl::testing::reap(again);
}

// With its only worker killed and no replacement, the run ends within its timeout with one
// clear error, not a hang.
TEST(RlProcesses, LosingEveryWorkerEndsTheRunWithAnError) {
  const std::string out = fresh_dir("killed");
  std::vector<Child> job =
      start_job(2, {"--preset", "tiny", "--task", "reverse", "--difficulty", "3", "--sft-steps",
                    "0", "--steps", "100000", "--timeout", "5", "--out", out});
  ASSERT_TRUE(wl::testing::wait_for_output(job[0], "rl [", comm::deadline_after(60s)))
      << job[0].output;
  wl::testing::kill_and_reap(job[1]);
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(wl::testing::wait_exit(job[0], comm::deadline_after(60s)), 1) << job[0].output;
  EXPECT_NE(job[0].output.find("every rollout worker is lost"), std::string::npos) << job[0].output;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
            40.0);
  for (Child& c : job) wl::testing::reap(c);
}

}  // namespace
}  // namespace wl::rl
