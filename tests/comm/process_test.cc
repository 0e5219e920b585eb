// Ranks as real processes, for what threads cannot show: a rank killed with SIGKILL in the
// middle of a collective, a rank frozen with SIGSTOP, a process with the wrong job token,
// and the launcher (prefixed output, torchrun variables, stopping the job when a rank fails).
// Each fault must turn into one known error on the surviving ranks within a bounded time.
// The moment of each fault is chosen by what the ranks print (the victim stops at a point it
// announces, and is killed or frozen there), never by sleeping.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "support/child_process.h"
#include "support/paths.h"
#include "weightlift/comm/launch/launch.h"
#include "weightlift/comm/store/tcp_store.h"
#include "weightlift/comm/transport/transport.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;

const std::string kRankBinary = wl::testing::beside_binary(WL_COMM_TEST_RANK);

using testing::Child;
using testing::free_port;
using testing::reap;
using testing::wait_exit;
using testing::wait_for_output;

// A rank in loop mode (comm_test_rank.cc): allreduces with `timeout_ms`; "passed MARK" after
// the MARKth, where the rank with `pause` stops.
Child spawn(int rank, int size, int port, const std::string& token, int timeout_ms, int mark = 0,
            bool pause = false) {
  std::vector<std::string> argv = {kRankBinary, "loop", std::to_string(timeout_ms),
                                   std::to_string(mark)};
  if (pause) argv.push_back("pause");
  return testing::spawn_child(argv, {{"RANK", std::to_string(rank)},
                                     {"WORLD_SIZE", std::to_string(size)},
                                     {"MASTER_ADDR", "127.0.0.1"},
                                     {"MASTER_PORT", std::to_string(port)},
                                     {"WEIGHTLIFT_JOB_TOKEN", token}});
}

int exit_code(StatusCode code) { return 10 + int(code); }

constexpr int kMark = 3;

// Starts `size` ranks in allreduce loops with `timeout_ms` and returns once every one has
// passed allreduce kMark. Rank `paused` stops there, before its next operation; the others
// are then inside allreduce kMark + 1, which cannot finish without it.
std::vector<Child> start_job(int size, int timeout_ms, int paused) {
  const int port = free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.push_back(spawn(r, size, port, "tok", timeout_ms, kMark, r == paused));
  }
  for (auto& c : ranks) {
    EXPECT_TRUE(wait_for_output(c, "passed " + std::to_string(kMark), deadline_after(20s)))
        << c.output;
  }
  return ranks;
}

// What a rank that failed printed ("failed: CODE: message"), waited for up to `bound`.
std::string failure_of(Child& c, Deadline bound) {
  return testing::wait_for_line(c, "failed: ", bound);
}

// Rank 1 stops between two allreduces and is killed there, while ranks 0 and 2 wait for it
// inside the next one. Both must see a dead peer (kUnavailable naming rank 1) long before
// their 20 s deadline. They stay alive until both have reported, so neither sees the other
// exit. Over TCP one more thing can happen: a survivor that fails closes the connections its
// cancelled requests used (transport.h), and the other may learn of that before it learns of
// rank 1; then it names the survivor, still with kUnavailable.
TEST(Process, SigkillMidCollectiveFailsTheOthersQuickly) {
  constexpr int kTimeoutMs = 20000;
  auto ranks = start_job(3, kTimeoutMs, /*paused=*/1);
  const auto killed = Clock::now();
  testing::kill_and_reap(ranks[1]);  // reaped at once: a zombie looks alive to a liveness check
  const Deadline bound = deadline_after(std::chrono::milliseconds(kTimeoutMs) / 2);
  std::string failures[3];
  for (int r : {0, 2}) failures[r] = failure_of(ranks[size_t(r)], bound);
  const bool tcp =
      std::getenv("UCX_TLS") != nullptr && std::string(std::getenv("UCX_TLS")) == "tcp";
  int named_rank1 = 0;
  for (int r : {0, 2}) {
    const std::string& f = failures[r];
    std::cerr
        << "[rank " << r << " after SIGKILL of rank 1, "
        << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killed).count()
        << " ms] " << f << "\n";
    EXPECT_EQ(f.rfind("failed: Unavailable: ", 0), 0u)
        << "rank " << r << ": " << ranks[size_t(r)].output;
    const bool names1 = f.find("connection to rank 1 failed") != std::string::npos;
    const bool names_other =
        f.find("connection to rank " + std::to_string(2 - r) + " failed") != std::string::npos;
    EXPECT_TRUE(names1 || (tcp && names_other)) << f;
    named_rank1 += names1;
  }
  EXPECT_GE(named_rank1, 1) << "the first to notice names the dead rank";
  for (int r : {0, 2}) {
    testing::close_stdin(ranks[size_t(r)]);
    EXPECT_EQ(wait_exit(ranks[size_t(r)], deadline_after(10s)),
              exit_code(StatusCode::kUnavailable));
  }
  for (auto& c : ranks) reap(c);
}

// Rank 1 stops between two allreduces and is frozen there: alive, never answering. Rank 0,
// inside the next allreduce, must give up at its deadline with kDeadlineExceeded naming it.
TEST(Process, SigstopGivesATimeout) {
  constexpr int kTimeoutMs = 1500;
  auto ranks = start_job(2, kTimeoutMs, /*paused=*/1);
  ::kill(ranks[1].pid, SIGSTOP);
  const std::string f =
      failure_of(ranks[0], deadline_after(std::chrono::milliseconds(kTimeoutMs) + 5s));
  EXPECT_EQ(f.rfind("failed: DeadlineExceeded: ", 0), 0u) << ranks[0].output;
  EXPECT_NE(f.find("rank 1"), std::string::npos) << f;
  testing::close_stdin(ranks[0]);
  EXPECT_EQ(wait_exit(ranks[0], deadline_after(10s)), exit_code(StatusCode::kDeadlineExceeded));
  for (auto& c : ranks) reap(c);
}

TEST(Process, WrongJobTokenIsRefused) {
  const int port = free_port();
  Child good = spawn(0, 2, port, "the-job", 3000);
  // The intruder knocks only once rank 0's store answers (a client with the job's token gets
  // in): then it must be refused by the store, not miss it.
  auto probe = TcpStore::connect({.port = port, .token = "the-job", .connect_timeout = 10s});
  ASSERT_TRUE(probe.ok()) << probe.status().to_string() << "\n" << good.output;
  probe->reset();
  Child bad = spawn(1, 2, port, "not-the-job", 3000);
  const int code = wait_exit(bad, deadline_after(10s));
  EXPECT_EQ(code, exit_code(StatusCode::kPermissionDenied)) << bad.output;
  EXPECT_NE(bad.output.find("token"), std::string::npos) << bad.output;
  // Rank 0 never sees its peer and gives up at its deadline rather than hanging.
  EXPECT_EQ(wait_exit(good, deadline_after(10s)), exit_code(StatusCode::kDeadlineExceeded))
      << good.output;
  reap(good);
  reap(bad);
}

// ---- launch ---------------------------------------------------------------------------------

struct Launched {
  int code = -1;
  std::string output;
};

Launched launch(int n, std::vector<std::string> command, int restart_failed = 0) {
  const int fd = ::memfd_create("launch-output", 0);
  auto r = run_launch({.nprocs = n,
                       .command = std::move(command),
                       .grace = 500ms,
                       .output_fd = fd,
                       .notice_fd = fd,
                       .restart_failed = restart_failed});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  Launched l;
  l.code = r.ok() ? *r : -1;
  ::lseek(fd, 0, SEEK_SET);
  char buf[4096];
  ssize_t got;
  while ((got = ::read(fd, buf, sizeof buf)) > 0) l.output.append(buf, size_t(got));
  ::close(fd);
  return l;
}

// Several hosts on this one: a launcher per "host", as threads, meeting at node 0's store.
std::vector<Launched> launch_hosts(int hosts, int per_host, const std::vector<std::string>& command,
                                   std::chrono::milliseconds host_timeout = 10s) {
  const int port = free_port();
  std::vector<Launched> out(static_cast<size_t>(hosts));
  std::vector<std::thread> launchers;
  for (int h = 0; h < hosts; ++h) {
    launchers.emplace_back([&, h] {
      const int fd = ::memfd_create("launch-output", 0);
      auto r = run_launch({.nprocs = per_host,
                           .nnodes = hosts,
                           .node_rank = h,
                           .job_token = "a-secret-all-hosts-share",
                           .join_timeout = 20s,
                           .host_timeout = host_timeout,
                           .command = command,
                           .master_port = port,
                           .grace = 500ms,
                           .output_fd = fd,
                           .notice_fd = fd});
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      out[size_t(h)].code = r.ok() ? *r : -1;
      ::lseek(fd, 0, SEEK_SET);
      char buf[4096];
      for (ssize_t got; (got = ::read(fd, buf, sizeof buf)) > 0;) {
        out[size_t(h)].output.append(buf, size_t(got));
      }
      ::close(fd);
    });
  }
  for (std::thread& t : launchers) t.join();
  return out;
}

// torchrun's contract across hosts: global ranks host by host, LOCAL_RANK within the host,
// GROUP_RANK the host; the ranks of both hosts run collectives together.
TEST(Launch, TwoHostsRunOneJob) {
  std::vector<Launched> l = launch_hosts(
      2, 2,
      {"sh", "-c",
       "echo \"$RANK/$WORLD_SIZE local $LOCAL_RANK/$LOCAL_WORLD_SIZE host $GROUP_RANK\""});
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(l[size_t(h)].code, 0) << l[size_t(h)].output;
    for (int local = 0; local < 2; ++local) {
      const int rank = 2 * h + local;
      EXPECT_NE(l[size_t(h)].output.find("[rank " + std::to_string(rank) + "] " +
                                         std::to_string(rank) + "/4 local " +
                                         std::to_string(local) + "/2 host " + std::to_string(h)),
                std::string::npos)
          << l[size_t(h)].output;
    }
  }
  l = launch_hosts(2, 2, {kRankBinary, "check"});
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(l[size_t(h)].code, 0) << l[size_t(h)].output;
    for (int local = 0; local < 2; ++local) {
      EXPECT_NE(l[size_t(h)].output.find("[rank " + std::to_string(2 * h + local) + "] ok\n"),
                std::string::npos)
          << l[size_t(h)].output;
    }
  }
}

// A rank that fails on one host stops every host's ranks, and every launcher exits with its
// code, naming it.
TEST(Launch, ARankFailingOnOneHostStopsEveryHost) {
  const auto start = Clock::now();
  std::vector<Launched> l =
      launch_hosts(2, 2, {"sh", "-c", "if [ \"$RANK\" = 3 ]; then exit 6; fi; sleep 30"});
  EXPECT_LT(Clock::now() - start, 15s);
  EXPECT_EQ(l[1].code, 6) << l[1].output;
  EXPECT_NE(l[1].output.find("rank 3 exited with code 6; stopping the other ranks on every host"),
            std::string::npos)
      << l[1].output;
  EXPECT_EQ(l[0].code, 6) << l[0].output;
  EXPECT_NE(l[0].output.find("the job failed at rank 3 (host 1), which exited with code 6"),
            std::string::npos)
      << l[0].output;
}

// A host whose ranks end first stops beating: it is done, not lost, and the other hosts' ranks
// run on; one whose rank fails after node 0's ranks ended well still fails node 0's launcher.
TEST(Launch, AHostDoneFirstIsNotLostAndALateFailureStillCounts) {
  std::vector<Launched> l = launch_hosts(
      2, 1, {"sh", "-c", "if [ \"$GROUP_RANK\" = 0 ]; then sleep 2.5; fi; echo done"}, 1s);
  for (const Launched& h : l) EXPECT_EQ(h.code, 0) << h.output;
  l = launch_hosts(2, 1, {"sh", "-c", "if [ \"$GROUP_RANK\" = 1 ]; then sleep 1; exit 9; fi"});
  EXPECT_EQ(l[1].code, 9) << l[1].output;
  EXPECT_EQ(l[0].code, 9) << l[0].output;
  EXPECT_NE(l[0].output.find("the job failed at rank 1 (host 1), which exited with code 9"),
            std::string::npos)
      << l[0].output;
}

TEST(Launch, SeveralHostsNeedAPortATokenAndAPlaceAmongThem) {
  auto r = run_launch({.nprocs = 1, .nnodes = 2, .node_rank = 0, .command = {"true"}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--master-port"), std::string::npos)
      << r.status().to_string();
  r = run_launch({.nprocs = 1,
                  .nnodes = 2,
                  .node_rank = 2,
                  .job_token = "t",
                  .command = {"true"},
                  .master_port = 1});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--node-rank 2 is not one of --nnodes 2's 0..1"),
            std::string::npos)
      << r.status().to_string();
}

TEST(Launch, SetsTorchrunVariablesAndPrefixesLines) {
  auto l = launch(3, {"sh", "-c",
                      "echo \"$RANK/$WORLD_SIZE local $LOCAL_RANK at $MASTER_ADDR "
                      "token ${#WEIGHTLIFT_JOB_TOKEN}\"; echo port=$MASTER_PORT; "
                      "printf 'no newline'"});
  EXPECT_EQ(l.code, 0) << l.output;
  for (int r = 0; r < 3; ++r) {
    const std::string p = "[rank " + std::to_string(r) + "] ";
    EXPECT_NE(l.output.find(p + std::to_string(r) + "/3 local " + std::to_string(r) +
                            " at 127.0.0.1 token 32\n"),
              std::string::npos)
        << l.output;
    EXPECT_NE(l.output.find(p + "no newline\n"), std::string::npos) << l.output;
  }
  EXPECT_EQ(l.output.find("port=0"), std::string::npos) << l.output;
  EXPECT_EQ(l.output.find("port=\n"), std::string::npos) << l.output;
}

TEST(Launch, AFailingRankStopsTheJobWithItsExitCode) {
  const auto start = Clock::now();
  auto l = launch(3, {"sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 30"});
  EXPECT_EQ(l.code, 7) << l.output;
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(l.output.find("rank 1 exited with code 7"), std::string::npos) << l.output;
}

// --restart-failed: a failed rank starts again with WEIGHTLIFT_RESTART set, up to the number
// of restarts allowed; rank 0 too, since the store is the launcher's.
TEST(Launch, AFailedRankIsStartedAgainWhileRestartsRemain) {
  // Rank 1 fails until its second restart.
  const std::vector<std::string> flaky = {
      "sh", "-c",
      "if [ \"$RANK\" = 1 ] && [ \"${WEIGHTLIFT_RESTART:-0}\" -lt 2 ]; then exit 5; fi; "
      "echo \"done restart=${WEIGHTLIFT_RESTART:-0}\""};
  Launched l = launch(2, flaky, 2);
  EXPECT_EQ(l.code, 0) << l.output;
  EXPECT_NE(l.output.find("rank 1 exited with code 5; starting it again (restart 1 of 2)"),
            std::string::npos)
      << l.output;
  EXPECT_NE(l.output.find("[rank 1] done restart=2"), std::string::npos) << l.output;
  l = launch(2, flaky, 1);  // one restart is not enough
  EXPECT_EQ(l.code, 5) << l.output;
  l = launch(2, {"sh", "-c", "if [ \"$RANK\" = 0 ]; then exit 4; fi; sleep 30"}, 0);
  EXPECT_EQ(l.code, 4) << l.output;
  EXPECT_EQ(l.output.find("starting it again"), std::string::npos) << l.output;
  l = launch(2,
             {"sh", "-c",
              "if [ \"$RANK\" = 0 ] && [ \"${WEIGHTLIFT_RESTART:-0}\" = 0 ]; then exit 4; fi; "
              "echo \"done restart=${WEIGHTLIFT_RESTART:-0}\""},
             1);
  EXPECT_EQ(l.code, 0) << l.output;
  EXPECT_NE(l.output.find("[rank 0] done restart=1"), std::string::npos) << l.output;
}

// The launcher runs the job's store: rank 0 may leave, or die, and the others still meet
// there (comm_test_rank's `store-outlives-rank0` mode).
TEST(Launch, TheStoreOutlivesRankZero) {
  auto l = launch(3, {kRankBinary, "store-after-rank0"});
  EXPECT_EQ(l.code, 0) << l.output;
  for (int r = 1; r < 3; ++r) {
    EXPECT_NE(l.output.find("[rank " + std::to_string(r) + "] met after rank 0 left\n"),
              std::string::npos)
        << l.output;
  }
}

TEST(Launch, ARankKilledBySignalCountsAs128PlusSignal) {
  auto l = launch(2, {"sh", "-c", "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30"});
  EXPECT_EQ(l.code, 128 + SIGKILL) << l.output;
}

TEST(Launch, RealRanksRunCollectives) {
  auto l = launch(3, {kRankBinary, "check"});
  EXPECT_EQ(l.code, 0) << l.output;
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(l.output.find("[rank " + std::to_string(r) + "] ok\n"), std::string::npos)
        << l.output;
  }
}

TEST(Launch, AJobPastItsDeadlineIsKilledAndNamed) {
  char path[] = "/tmp/wl_launch_deadline_XXXXXX";
  const int fd = ::mkstemp(path);
  ::unlink(path);
  const auto start = Clock::now();
  auto r = run_launch({.nprocs = 3,
                       .command = {"sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 0; fi; sleep 60"},
                       .output_fd = fd,
                       .deadline = 1500ms});
  ::close(fd);
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().to_string();
  EXPECT_NE(r.status().message().find("ranks 0, 2 had not finished within 1500 ms"),
            std::string::npos)
      << r.status().message();
  EXPECT_GE(Clock::now() - start, 1500ms);
  EXPECT_LT(Clock::now() - start, 10s);
}

std::string read_all(int fd) {
  std::string out;
  ::lseek(fd, 0, SEEK_SET);
  char buf[4096];
  ssize_t got;
  while ((got = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(got));
  ::close(fd);
  return out;
}

// The ranks' output can be piped on whole: the launcher's own lines go elsewhere (stderr). The
// last of them quotes the failed rank's last line: its error, which a person looks for there.
TEST(Launch, ItsOwnLinesGoApartFromTheRanks) {
  const int ranks = ::memfd_create("ranks", 0), notices = ::memfd_create("notices", 0);
  auto r = run_launch({.nprocs = 2,
                       .command = {"sh", "-c", "echo hello; [ \"$RANK\" = 1 ] && exit 3; exit 0"},
                       .grace = 500ms,
                       .output_fd = ranks,
                       .notice_fd = notices});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, 3);
  const std::string out = read_all(ranks), said = read_all(notices);
  EXPECT_NE(out.find("[rank 1] hello"), std::string::npos) << out;
  EXPECT_EQ(out.find("[launch]"), std::string::npos) << out;
  EXPECT_NE(said.find("[launch] rank 1 exited with code 3"), std::string::npos) << said;
  const std::string last = "[launch] the job failed at rank 1: hello\n";
  ASSERT_GE(said.size(), last.size()) << said;
  EXPECT_EQ(said.substr(said.size() - last.size()), last) << said;
  EXPECT_EQ(said.find("hello"), said.size() - last.size() + last.find("hello")) << said;
}

// A rank that fails on what it was given (exit code 2, InvalidArgument) is not started again:
// the same arguments would fail the same way, restarts or not.
TEST(Launch, ARankThatFailsOnItsArgumentsIsNotRestarted) {
  const int ranks = ::memfd_create("ranks", 0), notices = ::memfd_create("notices", 0);
  auto r =
      run_launch({.nprocs = 2,
                  .command = {"sh", "-c", "echo bad flag; [ \"$RANK\" = 1 ] && exit 2; exit 0"},
                  .grace = 500ms,
                  .output_fd = ranks,
                  .notice_fd = notices,
                  .restart_failed = 3});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, 2);
  const std::string out = read_all(ranks), said = read_all(notices);
  EXPECT_NE(said.find("[launch] rank 1 exited with code 2: its command line is wrong"),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("starting it again (restart"), std::string::npos) << said;
  // Started once: one line of its output.
  EXPECT_EQ(out.find("[rank 1] bad flag"), out.rfind("[rank 1] bad flag")) << out;
}

// A rank the job declares lost (stopped here, so it would never exit by itself) is killed by
// the launcher and started again while restarts remain; with none left the job still ends,
// with the others' exit code.
TEST(Launch, ARankTheJobDeclaresLostIsKilledAndStartedAgain) {
  const auto start = Clock::now();
  Launched l = launch(2, {kRankBinary, "declare-lost", "replaced"}, 1);
  EXPECT_EQ(l.code, 0) << l.output;
  EXPECT_NE(l.output.find("[launch] rank 1 was declared lost by the job; killing it"),
            std::string::npos)
      << l.output;
  EXPECT_NE(l.output.find("starting it again (restart 1 of 1)"), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("[rank 1] replacement is back"), std::string::npos) << l.output;
  EXPECT_EQ(l.output.find("let go on"), std::string::npos) << l.output;

  l = launch(2, {kRankBinary, "declare-lost"}, 0);
  EXPECT_EQ(l.code, 0) << l.output;
  EXPECT_NE(l.output.find("rank 1, declared lost by the job, is not started again"),
            std::string::npos)
      << l.output;
  EXPECT_NE(l.output.find("[rank 0] rank 0 done"), std::string::npos) << l.output;
  EXPECT_LT(Clock::now() - start, 20s);
}

// A launcher asked to stop (its SIGINT or SIGTERM handler sets stop_signal) passes SIGTERM to
// every rank, which may clean up and exit; the job's code is 128 + the signal, and no rank
// that the stop ended is started again.
TEST(Launch, AStopSignalStopsEveryRankWhichMayCleanUp) {
  const int fd = ::memfd_create("launch-output", 0);
  std::atomic<int> stop{0};
  // The stop comes once both ranks say their trap is set (before it, SIGTERM would end a shell
  // without its cleanup, and the test would check the shell, not the launcher).
  std::thread asker([&] {
    const auto give_up = Clock::now() + 20s;
    for (std::string seen; Clock::now() < give_up; std::this_thread::sleep_for(10ms)) {
      char buf[4096];
      const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
      seen.assign(buf, size_t(std::max<ssize_t>(n, 0)));
      if (seen.find("[rank 0] up") != std::string::npos &&
          seen.find("[rank 1] up") != std::string::npos)
        break;
    }
    stop.store(SIGINT);
  });
  const auto start = Clock::now();
  auto r = run_launch(
      {.nprocs = 2,
       .command = {"sh", "-c",
                   "trap 'echo cleaned up; kill $!; exit 0' TERM; echo up; sleep 30 & wait"},
       .grace = 5000ms,
       .output_fd = fd,
       .notice_fd = fd,
       .restart_failed = 3,
       .stop_signal = &stop});
  asker.join();
  const std::string out = read_all(fd);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, 128 + SIGINT) << out;
  EXPECT_LT(Clock::now() - start, 20s) << "the ranks should not have needed the SIGKILL";
  EXPECT_NE(out.find("[launch] stopped by SIGINT"), std::string::npos) << out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(out.find("[rank " + std::to_string(rank) + "] cleaned up"), std::string::npos) << out;
  }
  EXPECT_EQ(out.find("starting it again"), std::string::npos) << out;
}

TEST(Launch, MissingCommandIsExit127) {
  auto l = launch(1, {"/nonexistent/weightlift-test-command"});
  EXPECT_EQ(l.code, 127) << l.output;
  EXPECT_NE(l.output.find("cannot run"), std::string::npos) << l.output;
}

}  // namespace
}  // namespace wl::comm
