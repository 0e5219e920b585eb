// Ranks as real processes, for what threads cannot show: a rank killed with SIGKILL in the
// middle of a collective, a rank frozen with SIGSTOP, a process with the wrong job token,
// and the launcher (prefixed output, torchrun variables, stopping the job when a rank fails).
// Each fault must turn into an error on the surviving ranks within a bounded time.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "support/child_process.h"
#include "weightlift/comm/launch.h"
#include "weightlift/comm/transport.h"

namespace wl::comm {
namespace {

using namespace std::chrono_literals;

constexpr const char* kRankBinary = WL_COMM_TEST_RANK;

using testing::Child;
using testing::free_port;
using testing::reap;
using testing::wait_exit;
using testing::wait_for_output;

Child spawn(int rank, int size, int port, const std::string& token, int timeout_ms) {
  return testing::spawn_child({kRankBinary, "loop", std::to_string(timeout_ms)},
                              {{"RANK", std::to_string(rank)},
                               {"WORLD_SIZE", std::to_string(size)},
                               {"MASTER_ADDR", "127.0.0.1"},
                               {"MASTER_PORT", std::to_string(port)},
                               {"WEIGHTLIFT_JOB_TOKEN", token}});
}

int exit_code(StatusCode code) { return 10 + int(code); }

// Starts `size` ranks in allreduce loops with `timeout_ms`, all past their first barrier.
std::vector<Child> start_job(int size, int timeout_ms) {
  const int port = free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(spawn(r, size, port, "tok", timeout_ms));
  for (auto& c : ranks) {
    EXPECT_TRUE(wait_for_output(c, "ready", deadline_after(20s))) << c.output;
  }
  return ranks;
}

TEST(Process, SigkillMidCollectiveFailsTheOthersQuickly) {
  constexpr int kTimeoutMs = 4000;
  auto ranks = start_job(3, kTimeoutMs);
  std::this_thread::sleep_for(100ms);  // well inside the allreduce loop
  const auto start = Clock::now();
  ::kill(ranks[1].pid, SIGKILL);
  // Reap it at once, as a launcher does: a zombie still looks alive to a liveness check.
  ::waitpid(ranks[1].pid, nullptr, 0);
  // Reap the survivors as they exit, as a launcher would, each within the bound.
  const Deadline bound = deadline_after(std::chrono::milliseconds(kTimeoutMs) + 3s);
  std::vector<std::thread> waiters;
  int codes[3] = {-1, -1, -1};
  for (int r : {0, 2}) waiters.emplace_back([&, r] { codes[r] = wait_exit(ranks[size_t(r)], bound); });
  for (auto& t : waiters) t.join();
  for (int r : {0, 2}) {
    const int code = codes[r];
    EXPECT_TRUE(code == exit_code(StatusCode::kUnavailable) ||
                code == exit_code(StatusCode::kAborted) ||
                code == exit_code(StatusCode::kDeadlineExceeded))
        << "rank " << r << " exit " << code << ": " << ranks[size_t(r)].output;
    std::cerr << "[rank " << r << " after SIGKILL of rank 1, "
              << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
              << " ms] " << ranks[size_t(r)].output;
  }
  for (auto& c : ranks) reap(c);
}

TEST(Process, SigstopGivesATimeout) {
  constexpr int kTimeoutMs = 1500;
  auto ranks = start_job(2, kTimeoutMs);
  std::this_thread::sleep_for(100ms);
  ::kill(ranks[1].pid, SIGSTOP);
  const int code = wait_exit(ranks[0], deadline_after(std::chrono::milliseconds(kTimeoutMs) + 5s));
  EXPECT_EQ(code, exit_code(StatusCode::kDeadlineExceeded)) << ranks[0].output;
  EXPECT_NE(ranks[0].output.find("rank 1"), std::string::npos) << ranks[0].output;
  for (auto& c : ranks) reap(c);
}

TEST(Process, WrongJobTokenIsRefused) {
  const int port = free_port();
  Child good = spawn(0, 2, port, "the-job", 3000);
  // Let rank 0 start the store before the intruder knocks.
  std::this_thread::sleep_for(200ms);
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

Launched launch(int n, std::vector<std::string> command) {
  const int fd = ::memfd_create("launch-output", 0);
  auto r = run_launch({.nprocs = n, .command = std::move(command), .grace = 500ms,
                       .output_fd = fd});
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

TEST(Launch, ARankKilledBySignalCountsAs128PlusSignal) {
  auto l = launch(2, {"sh", "-c", "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30"});
  EXPECT_EQ(l.code, 128 + SIGKILL) << l.output;
}

TEST(Launch, RealRanksRunCollectives) {
  auto l = launch(3, {kRankBinary, "check"});
  EXPECT_EQ(l.code, 0) << l.output;
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(l.output.find("[rank " + std::to_string(r) + "] ok\n"), std::string::npos) << l.output;
  }
}

TEST(Launch, MissingCommandIsExit127) {
  auto l = launch(1, {"/nonexistent/weightlift-test-command"});
  EXPECT_EQ(l.code, 127) << l.output;
  EXPECT_NE(l.output.find("cannot run"), std::string::npos) << l.output;
}

}  // namespace
}  // namespace wl::comm
