// A buffer handed to the communication thread (parallel/data/comm_queue.h) and written by the
// compute thread while UCX copies it out for sending is a data race of ours, and
// ThreadSanitizer must report it under the options and suppressions the tsan test preset
// gives it (tests/tsan.supp). UCX is not instrumented: on the communication thread's side the
// only access ThreadSanitizer sees is UCX's memcpy out of our buffer (ucp_dt_pack's, or for a
// message of a FIFO element or less, uct_mm_ep_am_short's), so a suppression naming a UCX
// frame would hide exactly this race. Each case races in a child process (a death test) that
// must end with ThreadSanitizer's report and exit code 66; outside a ThreadSanitizer build
// the tests are skipped.
//
// Sizes: 64 bytes goes inline in the receiver's FIFO element, 512 bytes through ucp_dt_pack
// into a descriptor. Both stay under 1 KiB, where UCX copies with a memcpy call on every x86
// CPU; between 1 KiB and 8 MiB it copies with `rep movsb` on Intel (UCX_BUILTIN_MEMCPY_MIN and
// _MAX), which ThreadSanitizer cannot see at all.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "../comm/rank_threads.h"
#include "weightlift/parallel/data/comm_queue.h"

namespace wl::parallel {
namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

// Rank 0's compute thread queues a send of `bytes` and fills the buffer again once the
// communication thread has started the operation; rank 1 receives. The flag that says "started"
// is a relaxed atomic, which orders nothing for ThreadSanitizer, so the race is there in every
// run whichever access comes first.
void write_while_sent(size_t bytes) {
  auto store = std::make_shared<comm::MemoryStore>();
  comm::testing::run_ranks(2, [&](int rank) {
    auto g = comm::Group::connect({.store = store, .rank = rank, .size = 2});
    if (!g.ok()) std::_Exit(2);
    CommQueue queue(*g);
    std::vector<unsigned char> buf(bytes, 1);
    std::atomic<bool> started{false};
    uint64_t ticket = 0;
    if (rank == 0) {
      ticket = queue.submit([&](comm::Group& c) {
        started.store(true, std::memory_order_relaxed);
        return c.send({.data = buf.data(), .bytes = buf.size(), .peer = 1});
      });
      while (!started.load(std::memory_order_relaxed)) {
      }
      std::memset(buf.data(), 2, buf.size());  // the bug: the buffer is the queue's until wait()
    } else {
      ticket = queue.submit([&](comm::Group& c) {
        return c.recv({.data = buf.data(), .bytes = buf.size(), .peer = 0});
      });
    }
    if (!queue.wait(ticket).ok()) std::_Exit(3);
  });
}

void expect_reported(size_t bytes) {
  if (!kThreadSanitizer) GTEST_SKIP() << "a ThreadSanitizer build's check";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // With halt_on_error=1 (the preset's) the report ends the child at once; without it,
  // ThreadSanitizer turns exit(0) into 66 when it has reported anything.
  EXPECT_EXIT((write_while_sent(bytes), std::exit(0)), ::testing::ExitedWithCode(66),
              "ThreadSanitizer: data race")
      << "a buffer written while UCX copied it out went unreported: does tests/tsan.supp name a "
         "frame that UCX's side of the race shows?";
}

TEST(HandoffRace, AShortMessageWrittenWhileSentIsReported) { expect_reported(64); }
TEST(HandoffRace, APackedMessageWrittenWhileSentIsReported) { expect_reported(512); }

}  // namespace
}  // namespace wl::parallel
