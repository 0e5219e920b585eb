// Child processes for the real-process tests (style habit 8: faults on real processes): start
// one with its output captured, wait for a line or its exit under a deadline, and reap it.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "weightlift/comm/transport.h"

namespace wl::testing {

// Any port that is free now (the kernel picks one, we release it at once).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Child {
  pid_t pid = -1;
  int out = -1;        // stdout and stderr, non-blocking
  std::string output;  // everything read so far
};

// Runs argv[0] with `argv` and the extra environment `env`, stdout and stderr into a pipe.
inline Child spawn_child(const std::vector<std::string>& argv,
                         const std::vector<std::pair<std::string, std::string>>& env = {}) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  Child c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  c.out = fds[0];
  ::fcntl(c.out, F_SETFL, O_NONBLOCK);
  return c;
}

inline void drain(Child& c) {
  char buf[4096];
  ssize_t n;
  while ((n = ::read(c.out, buf, sizeof buf)) > 0) c.output.append(buf, size_t(n));
}

inline bool wait_for_output(Child& c, const std::string& what, comm::Deadline deadline) {
  while (comm::Clock::now() < deadline) {
    drain(c);
    if (c.output.find(what) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// The child's exit code (128 + signal if killed), or -1 if it is still running at the deadline.
inline int wait_exit(Child& c, comm::Deadline deadline) {
  while (comm::Clock::now() < deadline) {
    int st = 0;
    if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
      drain(c);
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    drain(c);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

// Kills (if still running) and reaps the child.
inline void reap(Child& c) {
  if (c.pid <= 0) return;
  ::kill(c.pid, SIGKILL);
  ::waitpid(c.pid, nullptr, 0);
  ::close(c.out);
  c.pid = -1;
}

}  // namespace wl::testing
