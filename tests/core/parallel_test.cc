// The compute pool (core/parallel.h): every index runs exactly once whatever the thread
// count, grain or size; loops nest and run from many threads at once without deadlock; an
// exception in a chunk reaches the caller and leaves the pool usable; a forked child, which
// has none of the parent's workers, still finishes its loops.
#include "weightlift/core/parallel.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

namespace wl {
namespace {

// Restores the thread count a test changed.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(num_threads()) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(saved_); }

 private:
  int saved_;
};

// Counts, per index, how often parallel_for handed it out, and checks the chunks' shape.
std::vector<int> visits_of_parallel_for(int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> hits(size_t(std::max<int64_t>(n, 0)));
  std::atomic<int> bad_chunks{0};
  parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    if (!(0 <= begin && begin < end && end <= n)) bad_chunks++;
    for (int64_t i = begin; i < end; ++i) hits[size_t(i)]++;
  });
  EXPECT_EQ(bad_chunks.load(), 0) << "n " << n << " grain " << grain;
  std::vector<int> out;
  for (auto& h : hits) out.push_back(h.load());
  return out;
}

TEST(ParallelFor, EveryIndexOnceForAnyThreadsGrainAndSize) {
  for (int threads : {1, 2, 3, 4}) {
    ThreadCount tc(threads);
    for (int64_t n : {0, 1, 2, 7, 64, 1000, 100003}) {
      for (int64_t grain : {1, 3, 64, 1 << 20}) {
        const std::vector<int> v = visits_of_parallel_for(n, grain);
        for (size_t i = 0; i < v.size(); ++i) {
          ASSERT_EQ(v[i], 1) << "index " << i << " n " << n << " grain " << grain << " threads "
                             << threads;
        }
      }
    }
  }
}

TEST(ParallelFor, ChunksAreAtLeastTheGrain) {
  ThreadCount tc(4);
  std::atomic<int64_t> smallest{INT64_MAX};
  parallel_for(1000, 100, [&](int64_t b, int64_t e) {
    int64_t s = smallest.load();
    while (e - b < s && !smallest.compare_exchange_weak(s, e - b)) {
    }
  });
  EXPECT_GE(smallest.load(), 100);
}

TEST(ParallelForEach, EveryUnitOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadCount tc(threads);
    for (int64_t n : {0, 1, 5, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      parallel_for_each(n, [&](int64_t i) { hits[size_t(i)]++; });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << i;
    }
  }
}

TEST(ParallelFor, NestedLoopsRunInline) {
  ThreadCount tc(3);
  std::vector<std::atomic<int>> hits(64 * 64);
  parallel_for_each(64, [&](int64_t i) {
    parallel_for(64, 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) hits[size_t(i * 64 + j)]++;
    });
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

// Ranks running as threads each call into the kernels at once: one of them gets the pool,
// the others run their loops on their own thread, and all finish.
TEST(ParallelFor, ConcurrentCallersAllFinish) {
  ThreadCount tc(2);
  constexpr int kCallers = 6, kLoops = 200;
  std::vector<int64_t> sums(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int l = 0; l < kLoops; ++l) {
        std::atomic<int64_t> sum{0};
        parallel_for(1000, 10, [&](int64_t b, int64_t e) {
          int64_t s = 0;
          for (int64_t i = b; i < e; ++i) s += i;
          sum += s;
        });
        sums[size_t(c)] += sum.load();
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int64_t s : sums) EXPECT_EQ(s, int64_t(kLoops) * 999 * 1000 / 2);
}

TEST(ParallelFor, AnExceptionReachesTheCallerAfterEveryChunkFinished) {
  ThreadCount tc(3);
  std::atomic<int> finished{0};
  EXPECT_THROW(parallel_for_each(50,
                                 [&](int64_t i) {
                                   if (i == 7) throw std::runtime_error("chunk 7");
                                   finished++;
                                 }),
               std::runtime_error);
  EXPECT_EQ(finished.load(), 49);
  // The pool is usable afterwards.
  const std::vector<int> v = visits_of_parallel_for(10000, 1);
  for (int x : v) ASSERT_EQ(x, 1);
}

TEST(ParallelFor, ResizingBetweenLoops) {
  for (int threads : {4, 1, 2, 3, 1}) {
    ThreadCount tc(threads);
    EXPECT_EQ(num_threads(), threads);
    const std::vector<int> v = visits_of_parallel_for(5000, 1);
    for (int x : v) ASSERT_EQ(x, 1);
  }
}

TEST(ParallelFor, AForkedChildWithoutWorkersStillFinishes) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer cannot follow a forked child that starts threads";
#endif
  ThreadCount tc(2);
  visits_of_parallel_for(1000, 1);  // the parent's workers exist now
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::vector<std::atomic<int>> hits(1000);
    parallel_for(1000, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
    });
    for (auto& h : hits) {
      if (h.load() != 1) _exit(1);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace wl
