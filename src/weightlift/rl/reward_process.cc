// reward_process.h. The process's stdin and stdout are sockets (socketpair), not pipes: a
// write to a process that died is then an EPIPE from send(MSG_NOSIGNAL), not a SIGPIPE that
// would kill the trainer.
#include "weightlift/rl/reward_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "weightlift/core/timing.h"

namespace wl::rl {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kStderrTail = 2048;  // bytes of the process's stderr an error quotes

std::string clip(std::string_view s, size_t n) {
  return s.size() <= n ? std::string(s) : std::string(s.substr(0, n)) + "...";
}

std::string query_line(const RewardQuery& q) {
  Json j = {{"prompt", q.prompt}, {"completion", q.completion}, {"ended", q.ended}};
  j["row"] = q.row_json.empty() ? Json() : Json::parse(q.row_json);
  // Invalid UTF-8 in a completion (a byte model can write any byte) is replaced, not refused.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

Result<RewardReply> parse_reply(std::string_view line) {
  Json j;
  try {
    j = Json::parse(line);
  } catch (const Json::exception&) {
    return invalid_argument("not JSON");
  }
  if (!j.is_object() || !j.contains("reward") || !j["reward"].is_number()) {
    return invalid_argument("not an object with a numeric \"reward\"");
  }
  RewardReply r{.reward = j["reward"].get<double>()};
  if (!std::isfinite(r.reward)) return invalid_argument("a reward that is not finite");
  if (j.contains("correct")) {
    if (!j["correct"].is_boolean()) return invalid_argument("\"correct\" that is not a boolean");
    r.correct = j["correct"].get<bool>();
  }
  return r;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace

Result<std::unique_ptr<RewardProcess>> RewardProcess::start(const std::string& command,
                                                            std::chrono::milliseconds timeout) {
  if (command.empty()) return invalid_argument("reward command is empty");
  int in[2], out[2], err[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) != 0) {
    return errno_status("reward process: socketpair", errno);
  }
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, out) != 0 ||
      ::pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(in[0]), ::close(in[1]);
    return errno_status("reward process: socketpair", e);
  }
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]}) ::close(fd);
    return errno_status("reward process: fork", e);
  }
  if (pid == 0) {  // the child: only async-signal-safe calls until exec
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(in[1], 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    // The command starts with no signal blocked (weightlift blocks its stop signals in every
    // thread but one, and a mask is inherited across exec).
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(argv[0], const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(in[1]), ::close(out[1]), ::close(err[1]);
  set_nonblocking(in[0]);
  set_nonblocking(out[0]);
  set_nonblocking(err[0]);
  return std::unique_ptr<RewardProcess>(
      new RewardProcess(command, timeout, pid, in[0], out[0], err[0]));
}

RewardProcess::RewardProcess(std::string command, std::chrono::milliseconds timeout, pid_t pid,
                             int in_fd, int out_fd, int err_fd)
    : command_(std::move(command)),
      timeout_(timeout),
      pid_(pid),
      in_fd_(in_fd),
      out_fd_(out_fd),
      err_fd_(err_fd) {}

RewardProcess::~RewardProcess() {
  // End of input is the process's cue to exit; one that does not within a moment is killed.
  ::close(in_fd_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(500);
  int status = 0;
  while (!reaped_ && ::waitpid(pid_, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      break;
    }
    ::usleep(2000);
  }
  ::close(out_fd_);
  ::close(err_fd_);
}

void RewardProcess::drain_stderr() {
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(err_fd_, buf, sizeof buf);
    if (n <= 0) return;
    stderr_tail_.append(buf, size_t(n));
    if (stderr_tail_.size() > kStderrTail) {
      stderr_tail_.erase(0, stderr_tail_.size() - kStderrTail);
    }
  }
}

Status RewardProcess::fail(const std::string& what, std::span<const RewardQuery> queries,
                           size_t sample, bool ended) {
  drain_stderr();
  std::string msg = "reward process `" + command_ + "` " + what;
  if (sample < queries.size()) {
    msg += " (sample " + std::to_string(sample) + " of the batch, prompt '" +
           clip(queries[sample].prompt, 80) + "')";
  }
  // A process that closed its end is exiting: give it a moment to be reaped, for its status.
  int status = 0;
  const auto until = Clock::now() + std::chrono::milliseconds(ended ? 1000 : 0);
  pid_t got = 0;
  while ((got = ::waitpid(pid_, &status, WNOHANG)) == 0 && Clock::now() < until) ::usleep(2000);
  if (got == pid_) {
    msg += WIFEXITED(status) ? "; it exited with status " + std::to_string(WEXITSTATUS(status))
                             : "; it was killed by signal " + std::to_string(WTERMSIG(status));
    reaped_ = true;
  }
  while (!stderr_tail_.empty() && (stderr_tail_.back() == '\n' || stderr_tail_.back() == ' ')) {
    stderr_tail_.pop_back();
  }
  msg += stderr_tail_.empty() ? "; its stderr is empty" : "; its stderr ends: " + stderr_tail_;
  broken_ = internal_error(msg);
  return *broken_;
}

Result<std::vector<RewardReply>> RewardProcess::score(std::span<const RewardQuery> queries) {
  if (broken_) return *broken_;
  // Between batches the process owes nothing: a line now is one more than the last batch
  // asked for, which would be taken as this batch's first reply.
  char extra[4096];
  const ssize_t got = ::read(out_fd_, extra, sizeof extra);
  if (got > 0 || !pending_.empty()) {
    if (got > 0) pending_.append(extra, size_t(got));
    return fail("answered more lines than it was asked: '" + clip(pending_, 120) + "'", {}, 0);
  }
  const Stopwatch clock;
  std::string input;
  for (const RewardQuery& q : queries) input += query_line(q);
  std::vector<RewardReply> replies;
  size_t written = 0;
  const auto deadline = Clock::now() + timeout_;
  while (replies.size() < queries.size()) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      char limit[32];
      std::snprintf(limit, sizeof limit, "%.3g", double(timeout_.count()) / 1000.0);
      return fail("did not answer within " + std::string(limit) + " s", queries, replies.size());
    }
    pollfd fds[3] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}, {in_fd_, POLLOUT, 0}};
    const nfds_t n = written < input.size() ? 3 : 2;
    if (::poll(fds, n, int(std::min<int64_t>(left.count(), 100))) < 0 && errno != EINTR) {
      return errno_status("reward process: poll", errno);
    }
    if (fds[1].revents) drain_stderr();
    if (n == 3 && fds[2].revents) {
      const ssize_t w = ::send(in_fd_, input.data() + written, input.size() - written,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0 && errno != EAGAIN && errno != EINTR) {
        return fail("stopped reading its input", queries, replies.size(), true);
      }
      if (w > 0) written += size_t(w);
    }
    if (!fds[0].revents) continue;
    char buf[65536];
    const ssize_t r = ::read(out_fd_, buf, sizeof buf);
    if (r == 0) return fail("closed its output", queries, replies.size(), true);
    if (r < 0) continue;  // EAGAIN
    pending_.append(buf, size_t(r));
    for (size_t nl; (nl = pending_.find('\n')) != std::string::npos;) {
      const std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (replies.size() == queries.size()) {
        return fail("answered more lines than it was asked", queries, queries.size());
      }
      Result<RewardReply> reply = parse_reply(line);
      if (!reply.ok()) {
        return fail("answered " + reply.status().message() + ": '" + clip(line, 120) + "'", queries,
                    replies.size());
      }
      replies.push_back(*reply);
    }
  }
  if (!pending_.empty()) {
    return fail("answered more lines than it was asked: '" + clip(pending_, 120) + "'", queries,
                queries.size());
  }
  seconds_ += clock.seconds();
  return replies;
}

}  // namespace wl::rl
