// A pipeline that survives a lost stage, as real processes of the real command: `weightlift
// launch -n 4 --restart-failed K -- weightlift train --pp 4 --recovery ...`, stages lost by
// the command's own failure drills (--kill: the process SIGKILLs itself as an iteration
// starts; --freeze: it SIGSTOPs itself), so that the moment is known rather than slept for.
// Each test reads what the run leaves: summary.json (every recovery), processes.json (the
// replacements' incarnations), metrics.jsonl (every step once), model.safetensors.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"
#include "support/scratch_dir.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/fault/failure_schedule.h"
#include "weightlift/fault/recovery.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"

namespace wl::fault {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;
using wl::testing::Child;
using wl::testing::reap;
using wl::testing::wait_exit;

const std::string kWeightlift = wl::testing::beside_binary(WL_WEIGHTLIFT_BINARY);
constexpr int kStages = 4;

std::string fresh_dir(const std::string& name) {
  std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(test.begin(), test.end(), '/', '_');
  const std::string d =
      ::testing::TempDir() + "/wl_fault_" + std::to_string(::getpid()) + "_" + test + "_" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  wl::testing::remove_at_exit(d);
  return d;
}

// Twenty small files in the Brown corpus's format.
std::string make_corpus() {
  const std::string dir = fresh_dir("corpus");
  const char* lines[] = {"\tThe/at jury/nn said/vbd no/at evidence/nn was/bedz found/vbn ./.",
                         "\tIt/pps recommended/vbd that/cs the/at city/nn act/vb ./.",
                         "\tShe/pps was/bedz there/rb ;/. he/pps said/vbd so/rb twice/rb ./."};
  for (int i = 0; i < 20; ++i) {
    std::ofstream f(dir + "/ca" + (i < 10 ? "0" : "") + std::to_string(i));
    for (int r = 0; r < 30; ++r) f << lines[(i + r) % 3] << "\n\n";
  }
  return dir;
}

// Four layers of tiny, one per stage.
std::string four_layers() {
  model::ModelConfig c = *model::preset("tiny");
  c.num_layers = kStages;
  const std::string path = fresh_dir("config") + "/config.json";
  EXPECT_TRUE(model::save_config(c, path).ok());
  return path;
}

class Pipeline : public ::testing::Test {
 protected:
  // The run's flags after `train`, without the drills and the strategy.
  std::vector<std::string> common(const std::string& out) const {
    return {"--config",        config_, "--corpus",     corpus_, "--pp",           "4",
            "--micro-batches", "2",     "--batch",      "4",     "--seq",          "32",
            "--steps",         "10",    "--eval-every", "5",     "--eval-windows", "8",
            "--out",           out,     "--timeout",    "10",    "--quiet"};
  }

  // `weightlift launch -n 4 --restart-failed restarts -- weightlift train <args>`: its exit code
  // and everything it printed.
  std::pair<int, std::string> launch(const std::vector<std::string>& args, int restarts,
                                     std::chrono::seconds bound = 60s) {
    std::vector<std::string> argv = {
        kWeightlift, "launch",    "-n", "4",    "--restart-failed", std::to_string(restarts), "--",
        kWeightlift, "--threads", "1",  "train"};
    argv.insert(argv.end(), args.begin(), args.end());
    Child c = wl::testing::spawn_child(argv, {});
    const int code = wait_exit(c, comm::deadline_after(bound));
    std::string out = c.output;
    reap(c);
    return {code, out};
  }

  static json read_json(const std::string& path) {
    std::ifstream f(path);
    return json::parse(f, nullptr, false);
  }

  // Every step 1..steps exactly once, in order.
  static void expect_every_step_once(const std::string& out, int steps) {
    std::ifstream f(out + "/metrics.jsonl");
    std::vector<int64_t> seen;
    for (std::string line; std::getline(f, line);) seen.push_back(json::parse(line)["step"]);
    ASSERT_EQ(int(seen.size()), steps);
    for (int i = 0; i < steps; ++i) EXPECT_EQ(seen[size_t(i)], i + 1);
  }

  static std::vector<int64_t> incarnations(const std::string& out) {
    std::vector<int64_t> inc;
    for (const json& p : read_json(out + "/processes.json")) inc.push_back(p["incarnation"]);
    return inc;
  }

  std::string corpus_ = make_corpus();
  std::string config_ = four_layers();
};

TEST_F(Pipeline, CheckFreeRebuildsAMiddleStageFromItsNeighbours) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree", "--kill", "4:1"});
  const auto [code, said] = launch(args, 1);
  ASSERT_EQ(code, 0) << said;
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  const json& r = s["recoveries"][0];
  EXPECT_EQ(r["iteration"], 4);
  EXPECT_EQ(r["step"], 3);
  EXPECT_EQ(r["stages"], json::parse(R"([{"stage": 1, "how": "average", "from": [0, 2]}])"));
  // The survivors notice within a fraction of a second (README): the dead peer's connections
  // fail at once, long before any collective's deadline.
  EXPECT_GE(r["detection_ms"].get<double>(), 0.0);
  EXPECT_LT(r["detection_ms"].get<double>(), 1000.0);  // measured 10-84 ms (release)
  std::printf("stage 1 killed: noticed in %.1f ms, rebuilt in %.1f ms\n",
              r["detection_ms"].get<double>(), r["recovery_ms"].get<double>());
  // Not a bar (that is the benchmark's, on `small`): the run did not wait for a deadline.
  EXPECT_LT(r["recovery_ms"].get<double>(), 8000.0);
  EXPECT_TRUE(r["loss_before"].is_number() && r["loss_after"].is_number()) << r.dump();
  EXPECT_EQ(s["steps"], 10);
  EXPECT_TRUE(s["final_val_loss"].is_number());
  EXPECT_EQ(incarnations(out), (std::vector<int64_t>{1, 2, 1, 1}));
  expect_every_step_once(out, 10);
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint-10/fault.json"));
}

// The rebuilt stage holds, bit for bit, CheckFree's rule applied to what its neighbours held
// when it was lost: the step-3 checkpoint has both neighbours' weights and their last
// post-clip gradient norms (fault.json), and --dump-rebuilds what stage 1 came back as.
TEST_F(Pipeline, CheckFreeRebuildIsItsNeighboursAverageWeightedByTheirNormsBitForBit) {
  const std::string out = fresh_dir("run"), dump = fresh_dir("dump");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree", "--kill", "4:1", "--checkpoint-every", "3",
                           "--dump-rebuilds", dump});
  const auto [code, said] = launch(args, 1);
  ASSERT_EQ(code, 0) << said;
  const std::string at_loss = out + "/checkpoint-3";
  const json groups = read_json(at_loss + "/fault.json");
  ASSERT_TRUE(groups.is_object()) << "no fault.json in " << at_loss;
  const double left_norm = groups["stages"][0]["blocks"]["norm"].get<double>(),
               right_norm = groups["stages"][2]["blocks"]["norm"].get<double>();
  // A stage's blocks are its layers' parameters in the layout's order; stage s holds layer s,
  // in the file of rank s.
  const model::ModelConfig config = *model::load_config(config_);
  const model::ParamLayout layout(config);
  const auto blocks_of = [&](int stage) {
    char file_name[64];
    std::snprintf(file_name, sizeof file_name, "/rank-%05d-of-%05d.safetensors", stage, kStages);
    auto file = SafetensorsFile::open(at_loss + file_name);
    EXPECT_TRUE(file.ok()) << file.status().to_string();
    std::vector<float> flat;
    if (!file.ok()) return flat;
    const std::string prefix = "layers." + std::to_string(stage) + ".";
    for (const model::ParamInfo& p : layout.params()) {
      if (p.name.rfind(prefix, 0) != 0) continue;
      auto t = file->get(p.name, DType::kF32, p.shape);
      EXPECT_TRUE(t.ok()) << t.status().to_string();
      if (!t.ok()) return flat;
      const float* x = static_cast<const float*>(t->raw());
      flat.insert(flat.end(), x, x + p.numel());
    }
    return flat;
  };
  const std::vector<float> left = blocks_of(0), right = blocks_of(2);
  ASSERT_FALSE(left.empty());
  ASSERT_EQ(left.size(), right.size());
  auto rebuilt = SafetensorsFile::open(dump + "/stage-1-iteration-4.safetensors");
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().to_string();
  EXPECT_EQ(rebuilt->metadata().at("how"), "average");
  EXPECT_EQ(rebuilt->metadata().at("from"), "[0,2]");
  // The norms the stage received are the ones its neighbours saved.
  double sent_left = 0, sent_right = 0;
  ASSERT_EQ(
      std::sscanf(rebuilt->metadata().at("norms").c_str(), "%la %la", &sent_left, &sent_right), 2);
  EXPECT_EQ(sent_left, left_norm);
  EXPECT_EQ(sent_right, right_norm);
  auto blocks = rebuilt->get("blocks", DType::kF32, {int64_t(left.size())});
  ASSERT_TRUE(blocks.ok()) << blocks.status().to_string();
  const float* got = static_cast<const float*>(blocks->raw());
  // CheckFree: each neighbour weighted by its norm (plus a small epsilon, so two zero norms
  // still average), in double, rounded once.
  const double wl = left_norm + kNormEpsilon, wr = right_norm + kNormEpsilon;
  int64_t differing = 0, first = -1;
  for (size_t i = 0; i < left.size(); ++i) {
    const float want = float((wl * double(left[i]) + wr * double(right[i])) / (wl + wr));
    if (std::memcmp(&want, &got[i], sizeof want) != 0 && differing++ == 0) first = int64_t(i);
  }
  EXPECT_EQ(differing, 0) << "of " << left.size() << " weights; the first at " << first;
  EXPECT_GT(left_norm, 0.0);
  EXPECT_NE(left_norm, right_norm);  // else an unweighted mean would pass too
}

// The stage holding the embedding and the one holding the head, each lost in turn: each comes
// back as a copy of its swap partner, its end unit from the partner's replica.
TEST_F(Pipeline, CheckFreePlusBringsBackTheEndStages) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree+", "--kill", "3:0", "--kill", "7:3"});
  const auto [code, said] = launch(args, 1);
  ASSERT_EQ(code, 0) << said;
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 2u) << s.dump(1);
  EXPECT_EQ(s["recoveries"][0]["stages"],
            json::parse(R"([{"stage": 0, "how": "copy", "from": [1]}])"));
  EXPECT_EQ(s["recoveries"][1]["stages"],
            json::parse(R"([{"stage": 3, "how": "copy", "from": [2]}])"));
  for (const json& r : s["recoveries"]) EXPECT_FALSE(r.contains("fallback")) << r.dump();
  EXPECT_EQ(incarnations(out), (std::vector<int64_t>{2, 1, 1, 2}));
  expect_every_step_once(out, 10);
}

// The baseline: a lost stage rolls every stage back to the newest checkpoint, and since the
// data position rolls back with it, the run ends with the bits of a run that lost nothing.
TEST_F(Pipeline, CheckpointRestartEndsWhereALosslessRunEnds) {
  const std::string lossless = fresh_dir("lossless"), lost = fresh_dir("lost");
  std::vector<std::string> a = common(lossless), b = common(lost);
  for (auto* args : {&a, &b}) {
    args->insert(args->end(), {"--recovery", "checkpoint", "--checkpoint-every", "3"});
  }
  b.insert(b.end(), {"--kill", "5:2"});
  const auto [code_a, said_a] = launch(a, 0);
  ASSERT_EQ(code_a, 0) << said_a;
  const auto [code_b, said_b] = launch(b, 1);
  ASSERT_EQ(code_b, 0) << said_b;
  const json s = read_json(lost + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  EXPECT_EQ(s["recoveries"][0]["rolled_back_to"], 3);
  EXPECT_EQ(s["recoveries"][0]["step"], 4);
  EXPECT_EQ(s["iterations"], 11);  // step 4 again after the rollback
  std::ifstream x(lossless + "/model.safetensors", std::ios::binary),
      y(lost + "/model.safetensors", std::ios::binary);
  const std::string bx((std::istreambuf_iterator<char>(x)), {}),
      by((std::istreambuf_iterator<char>(y)), {});
  EXPECT_FALSE(bx.empty());
  EXPECT_TRUE(bx == by) << "the rolled-back run's weights differ from the lossless run's";
  expect_every_step_once(lost, 10);
}

// Two neighbours lost at once: neither is rebuilt from the other, both from the nearest
// survivors on either side.
TEST_F(Pipeline, AdjacentStagesLostTogetherAverageTheNearestSurvivors) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree", "--kill", "4:1", "--kill", "4:2"});
  const auto [code, said] = launch(args, 1);
  ASSERT_EQ(code, 0) << said;
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  EXPECT_EQ(s["recoveries"][0]["stages"], json::parse(R"([
      {"stage": 1, "how": "average", "from": [0, 3]},
      {"stage": 2, "how": "average", "from": [0, 3]}])"));
}

// CheckFree has no rule for the first stage, which holds the embedding (the paper's Table 1):
// the run rolls back to the newest checkpoint and says why.
TEST_F(Pipeline, CheckFreeFallsBackToTheCheckpointForAnEndStage) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree", "--checkpoint-every", "2", "--kill", "4:0"});
  const auto [code, said] = launch(args, 1);
  ASSERT_EQ(code, 0) << said;
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  const json& r = s["recoveries"][0];
  EXPECT_EQ(r["rolled_back_to"], 2);
  EXPECT_NE(r["fallback"].get<std::string>().find("holds the embedding"), std::string::npos);
  expect_every_step_once(out, 10);
}

// A stage that hangs (SIGSTOP) is alive to the transport: the others' waits end at the
// deadline, it is declared gone and killed, and its replacement is rebuilt.
TEST_F(Pipeline, AFrozenStageIsDeclaredGoneAndReplaced) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args[args.size() - 2] = "2";  // --timeout
  args.insert(args.end(), {"--recovery", "checkfree", "--freeze", "4:2"});
  const auto [code, said] = launch(args, 1);
  ASSERT_EQ(code, 0) << said;
  EXPECT_NE(said.find("stage 2 (incarnation 1) did not answer within 2000 ms; declared gone, its "
                      "process"),
            std::string::npos)
      << said;
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  EXPECT_EQ(s["recoveries"][0]["stages"][0]["stage"], 2);
  EXPECT_EQ(incarnations(out), (std::vector<int64_t>{1, 1, 2, 1}));
}

// A kill from outside (an operator's kill -9, the OOM killer) is the same loss: here the test
// kills stage 1 once the run has reported its first step.
TEST_F(Pipeline, AKillFromOutsideIsRecoveredTheSameWay) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args[std::find(args.begin(), args.end(), "--steps") - args.begin() + 1] = "60";
  args[std::find(args.begin(), args.end(), "--eval-every") - args.begin() + 1] = "0";
  args.pop_back();  // --quiet: the first progress line is the cue
  args.insert(args.end(), {"--recovery", "checkfree"});
  std::vector<std::string> argv = {kWeightlift,        "launch", "-n",   "4",
                                   "--restart-failed", "1",      "--",   kWeightlift,
                                   "--threads",        "1",      "train"};
  argv.insert(argv.end(), args.begin(), args.end());
  Child job = wl::testing::spawn_child(argv, {});
  ASSERT_NE(wl::testing::wait_for_line(job, "[rank 0] train [", comm::deadline_after(60s)), "")
      << job.output;
  int64_t pid = 0;
  for (const json& p : read_json(out + "/processes.json")) {
    if (p["rank"] == 1) pid = p["pid"];
  }
  ASSERT_GT(pid, 1);
  ASSERT_EQ(::kill(pid_t(pid), SIGKILL), 0);
  EXPECT_EQ(wait_exit(job, comm::deadline_after(120s)), 0) << job.output;
  reap(job);
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  EXPECT_EQ(s["recoveries"][0]["stages"],
            json::parse(R"([{"stage": 1, "how": "average", "from": [0, 2]}])"));
  EXPECT_FALSE(s["recoveries"][0].contains("detection_ms"));  // no drill: no kill time
  EXPECT_EQ(incarnations(out), (std::vector<int64_t>{1, 2, 1, 1}));
  expect_every_step_once(out, 60);
}

// --fail-prob: the schedule is FailureSchedule's, the one the simulation draws, so the
// recoveries happen exactly at the iterations it names.
TEST_F(Pipeline, FailuresDrawnAtRandomFollowTheSchedule) {
  const double p = 0.06;
  const uint64_t seed = 11;
  FailureSchedule schedule(kStages, p, seed);
  std::set<int64_t> expected;
  int losses = 0;
  for (int64_t it = 1; it <= 10; ++it) {
    const size_t n = schedule.at(it).size();
    if (n > 0) expected.insert(it);
    losses += int(n);
  }
  ASSERT_GE(expected.size(), 1u) << "pick a seed that loses something in 10 iterations";
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree+", "--fail-prob", "0.06", "--fail-seed", "11",
                           "--checkpoint-every", "2"});
  const auto [code, said] = launch(args, losses);
  ASSERT_EQ(code, 0) << said;
  const json s = read_json(out + "/summary.json");
  std::set<int64_t> seen;
  for (const json& r : s["recoveries"]) seen.insert(r["iteration"].get<int64_t>());
  EXPECT_EQ(seen, expected) << s.dump(1);
}

// Under a launcher that does not restart anything (processes started by hand here, rank 0
// hosting the store), a lost stage's replacement is started by hand with the same variables
// and joins; without one, the others stop with an error naming the stage.
class ByHand : public Pipeline {
 protected:
  Child start_rank(int rank, int port, const std::vector<std::string>& args) {
    std::vector<std::string> argv = {kWeightlift, "--threads", "1", "train"};
    argv.insert(argv.end(), args.begin(), args.end());
    return wl::testing::spawn_child(argv, {{"RANK", std::to_string(rank)},
                                           {"WORLD_SIZE", "4"},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", std::to_string(port)},
                                           {"WEIGHTLIFT_JOB_TOKEN", "tok"}});
  }
};

TEST_F(ByHand, AReplacementStartedByHandJoins) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args.insert(args.end(), {"--recovery", "checkfree", "--kill", "4:2"});
  const int port = wl::testing::free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < kStages; ++r) ranks.push_back(start_rank(r, port, args));
  ASSERT_EQ(wait_exit(ranks[2], comm::deadline_after(60s)), 128 + SIGKILL) << ranks[2].output;
  reap(ranks[2]);
  ranks[2] = start_rank(2, port, args);
  for (int r = 0; r < kStages; ++r) {
    EXPECT_EQ(wait_exit(ranks[size_t(r)], comm::deadline_after(60s)), 0)
        << "rank " << r << ": " << ranks[size_t(r)].output;
    reap(ranks[size_t(r)]);
  }
  const json s = read_json(out + "/summary.json");
  ASSERT_EQ(s["recoveries"].size(), 1u) << s.dump(1);
  EXPECT_EQ(incarnations(out), (std::vector<int64_t>{1, 1, 2, 1}));
}

TEST_F(ByHand, WithoutAReplacementTheOthersStopNamingTheStage) {
  const std::string out = fresh_dir("run");
  std::vector<std::string> args = common(out);
  args[args.size() - 2] = "2";  // --timeout
  args.insert(args.end(), {"--recovery", "checkfree", "--kill", "4:2"});
  const int port = wl::testing::free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < kStages; ++r) ranks.push_back(start_rank(r, port, args));
  const auto started = std::chrono::steady_clock::now();
  for (int r = 0; r < kStages; ++r) {
    const int code = wait_exit(ranks[size_t(r)], comm::deadline_after(60s));
    if (r == 2) {
      EXPECT_EQ(code, 128 + SIGKILL);
    } else {
      EXPECT_EQ(code, 1) << ranks[size_t(r)].output;
      EXPECT_NE(ranks[size_t(r)].output.find("stage 2 was declared gone in epoch 0 and no "
                                             "replacement joined within 2000 ms"),
                std::string::npos)
          << ranks[size_t(r)].output;
    }
    reap(ranks[size_t(r)]);
  }
  // Two deadlines: one for its report, one for its replacement.
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);
}

}  // namespace
}  // namespace wl::fault
