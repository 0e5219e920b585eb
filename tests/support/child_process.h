// Child processes for the real-process tests (style habit 8: faults on real processes): start
// one with its output captured and its stdin ours to write, wait for a line or its exit under
// a deadline, and reap it.
//
// Nothing here sleeps: every wait is a poll() on the child's output pipe or on a pidfd that
// becomes readable when it exits, so a test's events are ordered by what the children say
// (a line they print when they reach a point) and never by how long something took.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "weightlift/comm/transport/transport.h"

namespace wl::testing {

// A port that is free now, for a job whose store a test starts on a port it names. It is
// drawn at random below the kernel's ephemeral range (ip_local_port_range), never from it: a
// port the kernel handed out once is handed out again to any process's connect() or bind(0),
// and under `ctest -j` another test's socket took one between this call and the job's bind.
// Two tests drawing the same port of the ~20000 is the remaining chance; the bind check
// below rules out one already in use.
inline int free_port() {
  int ephemeral_low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &ephemeral_low) != 1) ephemeral_low = 32768;
    std::fclose(f);
  }
  const int low = 10000, high = std::max(low + 1000, ephemeral_low);
  static std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(low, high - 1);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = pick(rng);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (free) return port;
  }
  return 0;  // never in practice; the job then fails on port 0 and says so
}

struct Child {
  pid_t pid = -1;
  int out = -1;        // its stdout and stderr, non-blocking
  int in = -1;         // its stdin; closing it is end-of-file there
  int pidfd = -1;      // readable once it has exited
  bool eof = false;    // its output is closed
  std::string output;  // everything read so far
};

// Runs argv[0] with `argv` and the extra environment `env`, stdout and stderr into a pipe,
// stdin from one.
inline Child spawn_child(const std::vector<std::string>& argv,
                         const std::vector<std::pair<std::string, std::string>>& env = {}) {
  // A child that died takes its stdin's read end with it: writing there must fail, not kill
  // the test.
  ::signal(SIGPIPE, SIG_IGN);
  // Close-on-exec, so that a later child does not hold an earlier one's pipes open.
  int out[2], in[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return {};
  if (::pipe2(in, O_CLOEXEC) != 0) return {};
  Child c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::dup2(in[0], 0);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(in[0]);
  c.out = out[0];
  c.in = in[1];
  ::fcntl(c.out, F_SETFL, O_NONBLOCK);
  c.pidfd = int(::syscall(SYS_pidfd_open, c.pid, 0));
  return c;
}

inline void drain(Child& c) {
  char buf[4096];
  ssize_t n;
  while ((n = ::read(c.out, buf, sizeof buf)) > 0) c.output.append(buf, size_t(n));
  if (n == 0) c.eof = true;
}

// Milliseconds to `deadline` for poll(), at least 0.
inline int poll_millis(comm::Deadline deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - comm::Clock::now());
  return int(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

// Blocks until the child prints more, closes its output, or the deadline.
inline void wait_for_more(Child& c, comm::Deadline deadline) {
  pollfd p{.fd = c.out, .events = POLLIN, .revents = 0};
  ::poll(&p, 1, poll_millis(deadline));
  drain(c);
}

// True once the child has printed `what` (it may have before the call).
inline bool wait_for_output(Child& c, const std::string& what, comm::Deadline deadline) {
  for (;;) {
    drain(c);
    if (c.output.find(what) != std::string::npos) return true;
    if (c.eof || comm::Clock::now() >= deadline) return false;
    wait_for_more(c, deadline);
  }
}

// The first whole line of output that starts with `prefix` (without its newline), or "" if
// none comes before the deadline.
inline std::string wait_for_line(Child& c, const std::string& prefix, comm::Deadline deadline) {
  for (;;) {
    drain(c);
    for (size_t at = 0; at < c.output.size();) {
      const size_t end = c.output.find('\n', at);
      if (end == std::string::npos) break;
      if (c.output.compare(at, prefix.size(), prefix) == 0) return c.output.substr(at, end - at);
      at = end + 1;
    }
    if (c.eof || comm::Clock::now() >= deadline) return "";
    wait_for_more(c, deadline);
  }
}

// Writes `text` to the child's stdin.
inline bool tell(Child& c, const std::string& text) {
  return ::write(c.in, text.data(), text.size()) == ssize_t(text.size());
}

// Closes the child's stdin (end-of-file there).
inline void close_stdin(Child& c) {
  if (c.in >= 0) ::close(c.in);
  c.in = -1;
}

// The child's exit code (128 + signal if killed), or -1 if it is still running at the deadline.
inline int wait_exit(Child& c, comm::Deadline deadline) {
  for (;;) {
    int st = 0;
    if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
      drain(c);
      c.pid = -1;
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    if (comm::Clock::now() >= deadline) return -1;
    // Its output keeps flowing while we wait, so that a chatty child never blocks on a full
    // pipe; the pidfd says when it is gone.
    pollfd p[2] = {{.fd = c.pidfd, .events = POLLIN, .revents = 0},
                   {.fd = c.eof ? -1 : c.out, .events = POLLIN, .revents = 0}};
    ::poll(p, 2, poll_millis(deadline));
    drain(c);
  }
}

// Kills with `signal` (and reaps) at once: a zombie still looks alive to a liveness check.
inline void kill_and_reap(Child& c, int signal = SIGKILL) {
  if (c.pid <= 0) return;
  ::kill(c.pid, signal);
  ::waitpid(c.pid, nullptr, 0);
  drain(c);
  c.pid = -1;
}

// Kills (if still running) and reaps the child, and closes what we hold of it.
inline void reap(Child& c) {
  kill_and_reap(c);
  for (int* fd : {&c.out, &c.in, &c.pidfd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

}  // namespace wl::testing
