// The RL loop's faults as real processes: a rollout worker killed and replaced by the
// launcher, workers joining and leaving a running job, a frozen worker, a replacement healing
// over TCP, a TP engine losing a rank, and every worker lost.
#include "process_fixture.h"

namespace wl::rl {
namespace {

using namespace process_testing;  // NOLINT: the fixture is what these tests are written in

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

// `weightlift launch -n 3 --restart-failed 1` of a run that goes on until stopped, writing into
// `out`, with the run's --timeout in seconds.
Child launch_until_stopped(const std::string& out, const std::string& timeout) {
  std::vector<std::string> argv = {kWeightlift,        "launch", "-n", "3",
                                   "--restart-failed", "1",      "--", kWeightlift,
                                   "--threads",        "1",      "rl"};
  for (const std::string& a : run_to_kill_in(kUntilStopped, out))
    argv.push_back(a == "20" ? timeout : a);  // --timeout
  return wl::testing::spawn_child(argv, {});
}

// A worker joining the running job of `args` whose store is on `port` (`rl --join`, with the
// job token `token`); `more`: flags given again with other values (another --preset: another
// model).
Child join_running_job(const std::vector<std::string>& args, int port,
                       const std::vector<std::string>& more, const std::string& token) {
  std::vector<std::string> argv = {kWeightlift, "--threads", "1", "rl"};
  argv.insert(argv.end(), args.begin(), args.end());
  for (size_t i = 0; i + 1 < more.size(); i += 2) {
    auto it = std::find(argv.begin(), argv.end(), more[i]);
    if (it != argv.end()) *(it + 1) = more[i + 1];
  }
  argv.push_back("--join");
  return wl::testing::spawn_child(argv, {{"MASTER_ADDR", "127.0.0.1"},
                                         {"MASTER_PORT", std::to_string(port)},
                                         {"WEIGHTLIFT_JOB_TOKEN", token}});
}

// What the elastic run in `out` recorded: the joins and the loss, each 20 steps or more after
// the last; every step trained all its samples, none stale, on the trainer's weights; and what
// a join cost (printed).
void check_elastic_run(const std::string& out) {
  const nlohmann::json summary = nlohmann::json::parse(std::ifstream(out + "/summary.json"));
  std::map<std::string, int64_t> at;  // event -> step
  for (const nlohmann::json& e : summary["events"]) {
    const std::string what = e["what"].get<std::string>();
    for (const char* k : {"rollout worker 2 joined the job", "rollout worker 3 joined the job",
                          "rollout worker 2 lost"})
      if (what.starts_with(k)) at[k] = e["step"].get<int64_t>();
  }
  ASSERT_EQ(at.size(), 3u) << summary["events"].dump();
  EXPECT_LE(at["rollout worker 2 joined the job"] + 20, at["rollout worker 3 joined the job"]);
  EXPECT_LE(at["rollout worker 3 joined the job"] + 20, at["rollout worker 2 lost"]);
  EXPECT_EQ(summary["max_staleness_trained"], 0);
  std::vector<double> step_ms;
  for (const nlohmann::json& j : read_records(out + "/rl_metrics.jsonl")) {
    if (j["phase"] != "rl") continue;
    EXPECT_EQ(j["trained"], 16) << j.dump();
    EXPECT_EQ(j["staleness"], nlohmann::json::array({16})) << j.dump();
    EXPECT_LT(j["logprob_gap_max"].get<double>(), kBf16Gap) << j.dump();
    step_ms.push_back(1e3 * j["step_s"].get<double>());
  }
  ASSERT_EQ(int64_t(step_ms.size()), summary["rl_steps_run"].get<int64_t>());
  EXPECT_EQ(summary["stopped_early"], true);
  // What a join cost the trainer (timings, printed, not held to a bar: the machine is shared).
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  std::printf("elastic: median step %.1f ms; joins' steps %.1f and %.1f ms, the loss's %.1f ms\n",
              sorted[sorted.size() / 2], step_ms[size_t(at["rollout worker 2 joined the job"] - 1)],
              step_ms[size_t(at["rollout worker 3 joined the job"] - 1)],
              step_ms[size_t(at["rollout worker 2 lost"] - 1)]);
}

// kill -9 of a rollout worker mid-run under `weightlift launch --restart-failed 1`: its share
// of the generation goes to the other worker, the launcher starts a replacement of the same
// rank, which heals the current weights (from its peer or the servers' copy) and rejoins; the
// run goes on and ends when asked, every trained sample came from the weights it was trained
// against, and processes.json names the replacement. That the replacement holds the trainer's
// weights is seen in what it samples: every step's largest log-probability gap between a sampled
// token's sampler and the trainer stays what bf16 weights give (kBf16Gap), where a worker on
// weights one version old or not healed at all would sample from another distribution.
TEST(RlProcesses, AKilledWorkerIsReplacedByTheLauncherAndHealsTheTrainersWeights) {
  const std::string out = fresh_dir("replaced");
  Child launch = launch_until_stopped(out, "20");
  ReapAtExit reaper;
  reaper.add(launch);
  ASSERT_TRUE(wl::testing::wait_for_output(launch, "rl [", comm::deadline_after(60s)))
      << launch.output;
  const pid_t killed = pid_of_rank(out, 2);
  ASSERT_GT(killed, 0);
  // Some way into a step: the death may be found by a weight update or mid-generation.
  std::this_thread::sleep_for(std::chrono::milliseconds(50 + getpid() % 200));
  ASSERT_EQ(::kill(killed, SIGKILL), 0);
  ASSERT_TRUE(
      wl::testing::wait_for_output(launch, "rollout worker 2 rejoined", comm::deadline_after(120s)))
      << launch.output;
  // 21: the rejoin is printed during step S (its event's step), and S's own record may be
  // written after this point, so 20 steps after S take one record more.
  ASSERT_TRUE(steps_on(out, 21, launch)) << launch.output;
  ASSERT_NO_FATAL_FAILURE(stop_trainer(out));
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
  EXPECT_EQ(rl, summary["rl_steps_run"].get<int>());
  EXPECT_EQ(summary["stopped_early"], true);
  EXPECT_GE(after_rejoin, 20) << "the run went on after the replacement rejoined";
  const nlohmann::json processes = nlohmann::json::parse(std::ifstream(out + "/processes.json"));
  pid_t replacement = 0;
  for (const nlohmann::json& p : processes)
    if (p["rank"] == 2) replacement = p["pid"].get<pid_t>();
  EXPECT_GT(replacement, 0) << processes.dump();
  EXPECT_NE(replacement, killed) << processes.dump();
  wl::testing::reap(launch);
}

// The fleet is elastic: a job started with one rollout worker takes two more that join it
// while it runs (`rl --join`, started by no launcher of the job's, with its store and token),
// and loses one of them (kill -9), and goes on until asked to end (SIGTERM to the trainer: the
// run ends after its step, every process exiting 0). Each joiner heals from its peer before it is
// given prompts, so every trained sample comes from the weights it was trained against
// (kBf16Gap) and no step lost samples; a joiner of another model or another job is refused
// naming why, before it connects to anything but the store, and the run does not notice.
TEST(RlProcesses, WorkersJoinAndLeaveARunningJob) {
  const std::string out = fresh_dir("elastic");
  const int port = wl::testing::free_port();
  // Until the changes below are done (each waits for 20 steps), at a learning rate that keeps
  // the policy as flat as it starts: the log-probability gaps then stay what bf16 weights give
  // all run long, and a joiner on other weights stands out.
  const std::vector<std::string> args = run_to_kill_in(kUntilStopped, out, {"--lr", "1e-5"});
  Child trainer = spawn_rank(0, 2, port, args), first = spawn_rank(1, 2, port, args);
  ReapAtExit reaper;
  reaper.add(trainer);
  reaper.add(first);
  auto join = [&](const std::vector<std::string>& more, const std::string& token) {
    return join_running_job(args, port, more, token);
  };
  // Each change once the job has gone on some steps since the last.
  ASSERT_TRUE(wl::testing::wait_for_output(trainer, "rl [", comm::deadline_after(60s)))
      << trainer.output;
  Child second = join({}, "tok");
  reaper.add(second);
  ASSERT_TRUE(wl::testing::wait_for_output(trainer, "rollout worker 2 joined the job",
                                           comm::deadline_after(60s)))
      << trainer.output << second.output;
  ASSERT_TRUE(steps_on(out, 20, trainer)) << trainer.output;
  Child third = join({}, "tok");
  reaper.add(third);
  ASSERT_TRUE(wl::testing::wait_for_output(trainer, "rollout worker 3 joined the job",
                                           comm::deadline_after(60s)))
      << trainer.output << third.output;
  ASSERT_TRUE(steps_on(out, 20, trainer)) << trainer.output;
  // Strangers: another model, another job.
  Child other_model = join({"--preset", "small"}, "tok"), other_job = join({}, "not-the-token");
  reaper.add(other_model);
  reaper.add(other_job);

  EXPECT_NE(wl::testing::wait_exit(other_model, comm::deadline_after(60s)), 0);
  EXPECT_NE(other_model.output.find("cannot join the running job"), std::string::npos)
      << other_model.output;
  EXPECT_NE(other_model.output.find("in the running job: a joining worker holds the job's model"),
            std::string::npos)
      << other_model.output;
  EXPECT_NE(wl::testing::wait_exit(other_job, comm::deadline_after(60s)), 0);
  EXPECT_NE(other_job.output.find("wrong job token"), std::string::npos) << other_job.output;
  ASSERT_TRUE(steps_on(out, 20, trainer)) << trainer.output;
  // Killed, and reaped at once as a launcher would: a zombie's shared memory still looks alive.
  ASSERT_EQ(::kill(second.pid, SIGKILL), 0);
  EXPECT_EQ(wl::testing::wait_exit(second, comm::deadline_after(10s)), 128 + SIGKILL);
  ASSERT_TRUE(
      wl::testing::wait_for_output(trainer, "rollout worker 2 lost", comm::deadline_after(60s)))
      << trainer.output;
  ASSERT_TRUE(steps_on(out, 20, trainer)) << trainer.output;
  ASSERT_NO_FATAL_FAILURE(stop_trainer(out));
  EXPECT_EQ(wl::testing::wait_exit(trainer, comm::deadline_after(120s)), 0) << trainer.output;
  EXPECT_EQ(wl::testing::wait_exit(first, comm::deadline_after(60s)), 0) << first.output;
  EXPECT_EQ(wl::testing::wait_exit(third, comm::deadline_after(60s)), 0) << third.output;
  EXPECT_NE(third.output.find("healed version"), std::string::npos) << third.output;
  for (Child* c : {&trainer, &first, &second, &third, &other_model, &other_job})
    wl::testing::reap(*c);
  check_elastic_run(out);
}

// A rollout worker frozen mid-run (SIGSTOP) never exits by itself: the trainer gives up on it
// at the timeout and says so to the launcher, which kills it and starts a replacement
// (--restart-failed); the run goes on until asked to end, and so does `weightlift launch`,
// with nothing left running.
TEST(RlProcesses, AFrozenWorkerIsKilledByTheLauncherAndTheJobEnds) {
  const std::string out = fresh_dir("frozen");
  Child launch = launch_until_stopped(out, "3");
  ReapAtExit reaper;
  reaper.add(launch);
  ASSERT_TRUE(wl::testing::wait_for_output(launch, "rl [", comm::deadline_after(60s)))
      << launch.output;
  const pid_t frozen = pid_of_rank(out, 2);
  ASSERT_GT(frozen, 0);
  ASSERT_EQ(::kill(frozen, SIGSTOP), 0);
  ASSERT_TRUE(wl::testing::wait_for_output(
      launch, "[launch] rank 2 was declared lost by the job; killing it",
      comm::deadline_after(60s)))
      << launch.output;
  ASSERT_TRUE(steps_on(out, 20, launch)) << launch.output;
  ASSERT_NO_FATAL_FAILURE(stop_trainer(out));
  EXPECT_EQ(wl::testing::wait_exit(launch, comm::deadline_after(120s)), 0) << launch.output;
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
// rank ends with an error), the other worker takes its prompts, and the run goes on to its end
// (when asked) with no sample lost and none stale. A rank of a TP worker started again is refused:
// it cannot join its running peers. (On one host the engine's surviving rank may learn of its
// peer's death only at the timeout of the collective it waits in; the step then takes that long.)
TEST(RlProcesses, AWorkerOfTwoTpRanksThatLosesOneIsDroppedAndTheRunFinishes) {
  const std::string out = fresh_dir("tp_rank_killed");
  const int port = wl::testing::free_port();
  const std::vector<std::string> args = run_to_kill_in(kUntilStopped, out, {"--rollout-tp", "2"});
  std::vector<Child> job;
  for (int r = 0; r < 5; ++r) job.push_back(spawn_rank(r, 5, port, args));
  ReapAtExit reaper;
  for (Child& c : job) reaper.add(c);
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
  reaper.add(again);
  EXPECT_EQ(wl::testing::wait_exit(again, comm::deadline_after(30s)), 1) << again.output;
  EXPECT_NE(again.output.find("cannot be replaced mid-run"), std::string::npos) << again.output;
  ASSERT_TRUE(
      wl::testing::wait_for_output(job[0], "rollout worker 2 lost", comm::deadline_after(120s)))
      << job[0].output;
  ASSERT_TRUE(steps_on(out, 20, job[0])) << job[0].output;
  ASSERT_NO_FATAL_FAILURE(stop_trainer(out));
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
  EXPECT_EQ(rl, summary["rl_steps_run"].get<int>());
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
