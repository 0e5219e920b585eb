// How a rank waits when it has nothing to do: spin, then yield, then nap.
//
// A short wait (a collective's hand-off, microseconds) is best spent spinning and yielding:
// the rank we wait for may be queued behind us on our own core, and the yield lets it run.
// A long wait (a receiver while the trainer writes hundreds of megabytes into it, a rank
// waiting out a slow peer) is better spent asleep. On 2 cores with a trainer and two
// receivers, the receivers' yielding spin took cycles from the writer: `weightlift bench
// transfer --preset medium --trainers 1 --receivers 2` wrote at 0.56 of single-thread memcpy.
// Napping only after kIdleBeforeNap of continuous idleness leaves the short waits as they were
// and costs a long one at most a nap's length: 50 us asked, about 100 us with Linux's default
// 50 us timer slack.
#pragma once

#include <sched.h>
#include <time.h>

#include <chrono>

namespace wl::comm::detail {

class IdleWait {
 public:
  static constexpr auto kIdleBeforeNap = std::chrono::milliseconds(2);
  static constexpr long kNapNanos = 50'000;

  // Something happened: the next idle stretch starts afresh.
  void busy() { idle_since_ = {}; }

  // Nothing happened this pass: yield, or nap once idle for long.
  void idle() {
    const auto now = std::chrono::steady_clock::now();
    if (idle_since_ == std::chrono::steady_clock::time_point{}) idle_since_ = now;
    if (now - idle_since_ < kIdleBeforeNap) {
      sched_yield();
      return;
    }
    const timespec nap{0, kNapNanos};
    nanosleep(&nap, nullptr);
  }

 private:
  std::chrono::steady_clock::time_point idle_since_{};
};

}  // namespace wl::comm::detail
