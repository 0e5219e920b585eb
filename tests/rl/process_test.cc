// The RL loop as real processes of the real command (`weightlift rl`, started as a launcher
// starts it): a trainer and rollout workers of every layout, weights through the p2p engine
// before every step, a dataset and a user's reward process, fp8, the asynchronous mode, and
// a run resumed from its checkpoint. The faults (workers killed, frozen, joining and leaving)
// are process_fault_test.cc's.
#include "process_fixture.h"
#include "weightlift/infer/dequant_linear.h"

namespace wl::rl {
namespace {

using namespace process_testing;  // NOLINT: the fixture is what these tests are written in

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

// Two trainer ranks and two rollout workers, under ZeRO-1 (each rank ends a step with the whole
// model) and under FSDP (each holds its shard only): each rank pushes the rows it owns, and the
// workers hold the whole model (every trained step's log-probabilities match the trainer's,
// which a stale or missing shard would not). The warm start's losses are the single trainer
// rank's (the router's balancing loss, taken over each rank's rows, makes the only difference)
// and FSDP's are ZeRO-1's; both ranks write their rows into the checkpoints, and a run resumed
// from one on two ranks writes the uninterrupted run's records step for step, in each layout.
TEST(RlProcesses, TwoTrainerRanksPushTheirOwnShardsAndTrainAsOne) {
  const std::vector<nlohmann::json> a = run_to_end(3, short_run({}), fresh_dir("one_trainer"));
  std::vector<std::vector<nlohmann::json>> layouts;
  std::vector<std::string> policies;
  for (const char* mode : {"zero1", "fsdp"}) {
    SCOPED_TRACE(mode);
    const std::string two = fresh_dir(std::string("two_trainers_") + mode),
                      resumed = fresh_dir(std::string("two_trainers_resumed_") + mode);
    const std::vector<std::string> two_ranks = {
        "--trainers", "2", "--trainer-dp-mode", mode, "--checkpoint-every", "2"};
    const std::vector<nlohmann::json> b = run_to_end(4, short_run(two_ranks), two);
    ASSERT_EQ(a.size(), b.size());
    const AgainstOneRank seen = expect_trains_as_one_rank(a, b);
    std::printf("two trainer ranks (%s): warm-start losses within %.2g of one rank's (relative)\n",
                mode, seen.worst_warm_start);
    const nlohmann::json summary = nlohmann::json::parse(std::ifstream(two + "/summary.json"));
    EXPECT_EQ(summary["trainer_ranks"], 2);
    EXPECT_EQ(summary["trainer_dp_mode"], mode);
    EXPECT_EQ(summary["rollout_workers"], 2);
    EXPECT_EQ(roles_of(two), (std::vector<std::string>{"trainer", "trainer-rank-1",
                                                       "rollout-worker-1", "rollout-worker-2"}));
    for (const char* f : {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"})
      EXPECT_TRUE(std::filesystem::exists(two + "/checkpoint-2/" + f)) << f;
    // The finished policy, gathered from the shards under FSDP, is the whole model.
    EXPECT_TRUE(std::filesystem::exists(two + "/model.safetensors"));
    std::vector<std::string> resume = two_ranks;
    resume.insert(resume.end(), {"--resume", two + "/checkpoint-2"});
    const std::vector<nlohmann::json> c = run_to_end(4, short_run(resume), resumed);
    ASSERT_EQ(b.size(), c.size());
    for (size_t i = 0; i < b.size(); ++i) {
      for (const char* k : {"phase", "step", "version", "loss", "reward_mean", "tokens"})
        EXPECT_EQ(b[i].value(k, nlohmann::json()), c[i].value(k, nlohmann::json()))
            << k << " of record " << i;
    }
    layouts.push_back(b);
    policies.push_back(two + "/model.safetensors");
  }
  // FSDP's warm start is ZeRO-1's: the same rows, the same sums over two ranks.
  ASSERT_EQ(layouts.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    if (layouts[0][i]["phase"] != "sft") continue;
    const double x = layouts[0][i]["loss"], y = layouts[1][i]["loss"];
    EXPECT_NEAR(y, x, kTwoRanksLoss * std::fabs(x)) << "fsdp's warm-start step " << i + 1;
  }
  // And so is the finished policy FSDP's rank 0 builds from every rank's rows: a row put in
  // the wrong place would be off by the weights' scale (0.02).
  const double apart = largest_difference(policies[0], policies[1]);
  EXPECT_LT(apart, kFsdpPolicy);
  std::printf("fsdp's finished policy within %.2g of zero1's (largest difference)\n", apart);
}

// Trainer ranks that split the model other than by rows: two tensor-parallel ranks (each
// holding its heads' and ffn rows' slices, the embedding whole on rank 0), two expert-parallel
// ones (each holding half of every layer's experts) and two pipeline stages (each its own
// layers, the policy loss taken on the last). Each sends the other the pieces of its own that
// belong to the other's shards (parallel/run/row_shards.h), and the workers hold the whole
// model: every trained step's sampling log-probabilities match the trainer's, which a missing
// or misplaced piece would not. The warm start's losses are the single trainer rank's, and
// the finished policy, gathered from the shards, is near it. Routing replay runs through each
// layout's policy step too (a stage replays its own layers' routes, an EP rank's tokens go to
// the replayed experts' ranks): what the trainer's routers would have chosen otherwise is
// the one-rank job's share.
TEST(RlProcesses, TensorExpertAndPipelineParallelTrainersFeedTheWorkers) {
  const std::string one = fresh_dir("one_trainer");
  const std::vector<nlohmann::json> a = run_to_end(3, short_run({"--routing-replay"}), one);
  for (const char* flag : {"--trainer-tp", "--trainer-ep", "--trainer-pp"}) {
    SCOPED_TRACE(flag);
    const std::string kind = std::string(flag).substr(10);  // "tp", "ep" or "pp"
    const std::string two = fresh_dir("trainer_" + kind + "2");
    const std::vector<nlohmann::json> b = run_to_end(
        4, short_run({"--trainers", "2", flag, "2", "--checkpoint-every", "2", "--routing-replay"}),
        two);
    ASSERT_EQ(a.size(), b.size());
    const AgainstOneRank seen = expect_trains_as_one_rank(a, b);
    double differ = 0, replayed_apart = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i]["phase"] != "rl" || a[i]["trained"].get<int64_t>() == 0) continue;
      const double x = a[i]["replay_differ"], y = b[i]["replay_differ"];
      EXPECT_NEAR(y, x, kReplayDiffer) << "RL step " << a[i]["step"];
      differ = std::max(differ, x);
      replayed_apart = std::max(replayed_apart, std::fabs(y - x));
    }
    std::printf(
        "trainer %s 2 replaying the rollouts' routes: its routers' own choice differs on "
        "%.3g of token-layers, %.2g from one rank's share\n",
        kind.c_str(), differ, replayed_apart);
    const nlohmann::json summary = nlohmann::json::parse(std::ifstream(two + "/summary.json"));
    EXPECT_EQ(summary["trainer_ranks"], 2);
    EXPECT_EQ(summary["trainer_" + kind], 2);
    for (const char* f : {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"})
      EXPECT_TRUE(std::filesystem::exists(two + "/checkpoint-2/" + f)) << f;
    const double apart = largest_difference(one + "/model.safetensors", two + "/model.safetensors");
    EXPECT_LT(apart, kModelParallelPolicy);
    std::printf(
        "trainer %s 2: warm-start losses within %.2g of one rank's (relative), largest "
        "sampling gap %.3g, finished policy within %.2g of one rank's\n",
        kind.c_str(), seen.worst_warm_start, seen.largest_gap, apart);
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
// slices of the weights, received straight from the trainer), and of two EP ranks each (each
// holding one run of the experts, generating half the rows, tokens going to their experts'
// ranks and back), sample what one-rank workers sample: the same tokens, so the same rewards
// and nearly the same losses (the logits differ by f32 reassociation only). Two trainer ranks
// pushing to them run too: DDP to TP engines, and FSDP to EP engines (seed 000's layout), each
// trainer rank pushing only its shard and each EP rank receiving only its experts. So does a
// worker of TP 2 x EP 2 decoding its rows over 3 slots (continuous batching) per EP rank, its
// weights widened to f32 once per request instead of a band per step.
TEST(RlProcesses, RolloutWorkersOfTwoTpOrEpRanksSampleAsOneRankWorkers) {
  const std::string one = fresh_dir("tp1_workers");
  const std::vector<nlohmann::json> a = run_to_end(3, short_run({}), one);
  for (const char* engine : {"--rollout-tp", "--rollout-ep"}) {
    SCOPED_TRACE(engine);
    const std::string kind = std::string(engine).substr(10);  // "tp" or "ep"
    const std::string two = fresh_dir(kind + "2_workers"),
                      both = fresh_dir(kind + "2_workers_two_trainers");
    const std::vector<nlohmann::json> b = run_to_end(5, short_run({engine, "2"}), two);
    ASSERT_EQ(a.size(), b.size());
    int trained = 0;
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i]["phase"] == "sft") continue;
      trained += a[i]["trained"].get<int64_t>() > 0;
      for (const char* k : {"trained", "reward_mean", "tokens", "version"})
        EXPECT_EQ(a[i][k], b[i][k]) << k << " of RL step " << a[i]["step"];
      const double x = a[i]["loss"], y = b[i]["loss"];
      EXPECT_NEAR(y, x, workers_loss_bound(x)) << "RL step " << a[i]["step"];
      worst = std::max(worst, std::fabs(y - x));
    }
    EXPECT_GT(trained, 0) << "no RL step trained";
    std::printf("%s-2 workers: RL losses within %.2g of one-rank workers'\n", kind.c_str(), worst);
    const std::string r = "-" + kind + "-rank-";
    EXPECT_EQ(roles_of(two),
              (std::vector<std::string>{"trainer", "rollout-worker-1" + r + "0",
                                        "rollout-worker-1" + r + "1", "rollout-worker-2" + r + "0",
                                        "rollout-worker-2" + r + "1"}));
    const std::string dp = kind == "tp" ? "ddp" : "fsdp";
    for (const nlohmann::json& rec : run_to_end(
             6, short_run({engine, "2", "--trainers", "2", "--trainer-dp-mode", dp}), both)) {
      if (rec["phase"] == "rl" && rec["trained"].get<int64_t>() > 0) {
        EXPECT_LT(rec["logprob_gap_max"].get<double>(), kBf16Gap) << rec.dump();
      }
    }
  }
  // One worker of TP 2 x EP 2 (four processes), over slots, against one worker of one.
  const std::string four_dir = fresh_dir("tp2_ep2_worker");
  const std::vector<nlohmann::json> single = run_to_end(2, short_run({}), fresh_dir("one_worker")),
                                    four =
                                        run_to_end(5,
                                                   short_run({"--rollout-tp", "2", "--rollout-ep",
                                                              "2", "--rollout-slots", "3",
                                                              "--rollout-widen-per-generation"}),
                                                   four_dir);
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(four_dir + "/summary.json"));
  EXPECT_EQ(summary["rollout_widen_per_generation"], true);
  ASSERT_EQ(single.size(), four.size());
  for (size_t i = 0; i < single.size(); ++i) {
    if (single[i]["phase"] == "sft") continue;
    for (const char* k : {"trained", "reward_mean", "tokens", "version"})
      EXPECT_EQ(single[i][k], four[i][k]) << k << " of RL step " << single[i]["step"];
    const double x = single[i]["loss"], y = four[i]["loss"];
    EXPECT_NEAR(y, x, workers_loss_bound(x)) << "RL step " << single[i]["step"];
  }
}

// Rollout engines with bf16 activations (on a CPU with bf16 GEMMs; elsewhere the flag changes
// nothing, and the test is skipped): the loop runs, and the sampler stays as near the trainer as
// bf16 weights keep it (kBf16Gap), the activations' rounding being of the same size as the
// weights'.
TEST(RlProcesses, RolloutsWithBf16ActivationsStayNearTheTrainer) {
  if (!infer::bf16_activations_supported()) GTEST_SKIP() << "this CPU has no bf16 GEMMs";
  const std::string out = fresh_dir("bf16_activations");
  int trained = 0;
  for (const nlohmann::json& rec : run_to_end(3, short_run({"--rollout-bf16-activations"}), out)) {
    if (rec["phase"] != "rl" || rec["trained"].get<int64_t>() == 0) continue;
    ++trained;
    EXPECT_LT(rec["logprob_gap_max"].get<double>(), kBf16Gap) << rec.dump();
  }
  EXPECT_GT(trained, 0) << "no RL step trained";
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  EXPECT_EQ(summary["rollout_bf16_activations"], true);
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

// Token dropping in the loop (--capacity-factor): the rollout engines drop slots over each
// pass's capacity and record which in the routes; with routing replay the trainer drops
// exactly those, so its log-probabilities are the sampler's up to the bf16 weights (gap under
// kBf16Gap), and the drop rate is in every trained step's record. Without replay the trainer
// drops by its own capacity over the whole batch, other slots than each decode step did, and
// the sampler's log-probabilities are further from its own.
TEST(RlProcesses, RolloutsDropOverCapacityAndTheTrainerReplaysTheirDrops) {
  std::map<bool, double> gap;  // mean over trained steps, by replay
  for (const bool replay : {true, false}) {
    SCOPED_TRACE(replay ? "replay" : "no replay");
    const std::string out = fresh_dir(replay ? "drops_replayed" : "drops_own");
    std::vector<std::string> flags = {"--capacity-factor", "0.5"};
    if (replay) flags.push_back("--routing-replay");
    int trained = 0;
    double sum = 0;
    for (const nlohmann::json& r : run_to_end(3, short_run(flags), out)) {
      if (r["phase"] != "rl" || r["trained"].get<int64_t>() == 0) continue;
      ++trained;
      sum += r["logprob_gap_mean"].get<double>();
      EXPECT_GT(r["drop_rate"].get<double>(), 0.0) << r.dump();
      if (replay) {
        EXPECT_LT(r["logprob_gap_max"].get<double>(), kBf16Gap) << r.dump();
      }
    }
    ASSERT_GT(trained, 0) << "no RL step trained";
    gap[replay] = sum / trained;
    const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
    EXPECT_EQ(summary["capacity_factor"], 0.5);
  }
  std::printf("mean sampling gap with the rollout's drops replayed %.3g, without %.3g\n", gap[true],
              gap[false]);
  EXPECT_LT(gap[true], gap[false]);
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

}  // namespace
}  // namespace wl::rl
