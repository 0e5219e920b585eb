// Turns: two benchmark programs measuring by turns, so that each size's figures for both come
// from the same minutes of the machine.
//
// On these virtual machines the time one cache line takes between the two vCPUs changes with
// where the hypervisor runs them (docs/algorithms.md, "Where the slow runs came from"), and the
// state can change within milliseconds or hold for minutes. A small allreduce's whole
// measurement lasts well under a millisecond, so two programs measured one after the other
// compare one sample of the machine against another. Taking turns in short blocks, the
// comparison is between implementations, not between moments.
//
// The driver (bench/compare_collectives.py --turns) makes two FIFOs per rank in a directory:
//   <impl>.<rank>.go    the driver writes one byte: this rank's next block may run
//   <impl>.<rank>.done  the rank writes one byte when its block is over
// It opens every `done` FIFO for reading before it starts the programs, and a rank opens its
// `go` FIFO for reading before its first turn, so neither open blocks. Between turns a rank
// sleeps in poll(), so a program whose turn it is not takes no CPU from the one measuring;
// for that, everything else a program does (allocating and touching its buffers, sorting its
// times, printing) must happen inside its own turns too.
// Header-only and free of weightlift types: the OpenMPI peer (bench/mpi_collectives.cc)
// includes it too. Errors are returned as text ("" when all went well); open()'s name the
// file, the others also say they come from the turns.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

namespace wl::app {

// How long a rank waits for its turn: the other program's block may be a 256 MiB collective
// of a slow implementation, far longer than any one call of ours.
inline constexpr std::chrono::minutes kTurnTimeout{10};

class Turns {
 public:
  Turns() = default;  // no turns: every wait returns at once
  Turns(const Turns&) = delete;
  Turns& operator=(const Turns&) = delete;
  ~Turns() {
    if (go_ >= 0) ::close(go_);
    if (done_ >= 0) ::close(done_);
  }

  // Opens `dir`/`impl`.`rank`.{go,done}. An empty `dir` means no turns.
  std::string open(const std::string& dir, const std::string& impl, int rank) {
    if (dir.empty()) return "";
    const std::string base = dir + "/" + impl + "." + std::to_string(rank);
    // A driver that has gone away must be an error from write(), not a SIGPIPE that kills us.
    ::signal(SIGPIPE, SIG_IGN);
    go_ = ::open((base + ".go").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (go_ < 0) return "cannot open " + base + ".go: " + std::strerror(errno);
    done_ = ::open((base + ".done").c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (done_ < 0) {
      const int error = errno;
      ::close(go_);
      go_ = -1;  // not active(): no half-open turns
      return "cannot open " + base + ".done: " + std::strerror(error) +
             (error == ENXIO ? " (no driver is reading it)" : "");
    }
    name_ = base;
    return "";
  }

  bool active() const { return go_ >= 0; }

  // Sleeps until the driver gives this rank its turn, at most `timeout`.
  std::string wait(std::chrono::milliseconds timeout) {
    if (!active()) return "";
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        return "turns: no turn for " + name_ + " within " + std::to_string(timeout.count()) +
               " ms (is the driver still there?)";
      }
      pollfd p{.fd = go_, .events = POLLIN, .revents = 0};
      const int n = ::poll(&p, 1, int(std::min<long long>(left.count(), 1000)));
      if (n < 0 && errno != EINTR) return std::string("turns: poll: ") + std::strerror(errno);
      if (n <= 0) continue;
      char byte = 0;
      const ssize_t got = ::read(go_, &byte, 1);
      if (got == 1) return "";
      if (got == 0) return "turns: the driver closed " + name_ + ".go before this rank's last turn";
      if (errno != EAGAIN && errno != EINTR)
        return "turns: read " + name_ + ".go: " + std::strerror(errno);
    }
  }

  // Tells the driver this rank's block is over.
  std::string end() {
    if (!active()) return "";
    const char byte = 'd';
    if (::write(done_, &byte, 1) == 1) return "";
    return "turns: write " + name_ + ".done: " + std::strerror(errno);
  }

 private:
  int go_ = -1, done_ = -1;
  std::string name_;
};

}  // namespace wl::app
