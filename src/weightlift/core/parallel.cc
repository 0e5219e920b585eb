// The compute pool of parallel.h. One job at a time: the caller publishes it (a function and a
// chunk count), wakes the workers, and claims chunks with them; a claim is a compare-and-swap
// on one 64-bit word holding (next chunk, chunk count), so a worker that went to sleep during
// one job can never claim a chunk of the next with the old job's function: its swap fails
// unless the word it read is the live one. The caller returns when the count of finished
// chunks reaches the job's count.
#include "weightlift/core/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "weightlift/core/mutex.h"

namespace wl {
namespace {

// How long an idle thread waits for the next loop before it sleeps in the kernel. The loops of
// a decode step are tens of microseconds apart and as short, so a worker that had to be woken
// for each (tens of microseconds) would halve decoding; a millisecond covers them. Past the
// first kPureSpin every turn of the wait yields the core, so a thread sharing its core with
// the one doing the work, or with another process, gives it back at once.
constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr auto kPureSpin = std::chrono::microseconds(5);
// Chunks per thread: enough that a thread slowed by a neighbour hands most of its share to the
// others, few enough that claiming costs nothing next to a chunk.
constexpr int64_t kChunksPerThread = 4;
// A sanity bound on --threads; more than this is a typo, not a machine.
constexpr int kMaxThreads = 1024;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until pred() holds or kSpin has passed; true if it holds. Past kPureSpin every turn
// yields the core, so the spin costs nothing when anything else on that core wants it.
template <class Pred>
bool spin_until(Pred pred) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (pred()) return true;
    if (i < 64) {
      cpu_relax();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - start >= kSpin) return false;
    if (now - start >= kPureSpin) std::this_thread::yield();
  }
}

void pool_after_fork();

// Set on pool workers, and on a caller while its loop runs: a loop started there runs inline.
thread_local bool tls_in_loop = false;

class Pool {
 public:
  Pool() {
    // A forked child has none of the workers: it forgets them, and starts its own if it runs
    // a loop (joining them at exit would wait forever).
    pthread_atfork(nullptr, nullptr, [] { pool_after_fork(); });
  }
  ~Pool() { stop_workers(); }  // no one else uses the pool now (destructors go unchecked)

  // In a forked child: the parent's workers do not exist here. Without run_mu_: a thread of the
  // parent may have held it at the fork, and then no one ever releases it in the child.
  void forget_workers() WL_NO_THREAD_SAFETY_ANALYSIS {
    for (std::thread& t : workers_) t.detach();
    workers_.clear();
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void resize(int threads) WL_EXCLUDES(run_mu_) {
    MutexLock lock(run_mu_);
    stop_workers();
    threads_.store(threads, std::memory_order_relaxed);
  }

  // Runs invoke(ctx, c) for c in [0, count) with the workers' help. False, having run nothing,
  // when another thread is using the pool.
  bool try_run(uint32_t count, void (*invoke)(const void*, int64_t), const void* ctx)
      WL_EXCLUDES(run_mu_) {
    if (!run_mu_.try_lock()) return false;
    MutexLock lock(run_mu_, std::adopt_lock);
    if (workers_.empty()) start_workers();
    Job job{invoke, ctx, count};
    {
      MutexLock error_lock(error_mu_);
      error_ = nullptr;
    }
    done_.store(0, std::memory_order_relaxed);
    job_.store(&job, std::memory_order_relaxed);
    work_.store(uint64_t(count), std::memory_order_release);  // next chunk 0 of `count`
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();
    tls_in_loop = true;
    run_claimed_chunks();
    tls_in_loop = false;
    for (uint32_t d; (d = done_.load(std::memory_order_acquire)) != count;) {
      if (!spin_until([&] { return done_.load(std::memory_order_acquire) != d; })) {
        done_.wait(d, std::memory_order_acquire);
      }
    }
    std::exception_ptr error;
    {
      MutexLock error_lock(error_mu_);
      error = std::exchange(error_, nullptr);
    }
    if (error) std::rethrow_exception(error);
    return true;
  }

 private:
  struct Job {
    void (*invoke)(const void*, int64_t);
    const void* ctx;
    uint32_t count;
  };

  // Claims the next chunk of the live job, if it has one left.
  bool claim(uint32_t* chunk) {
    uint64_t w = work_.load(std::memory_order_acquire);
    while (uint32_t(w >> 32) < uint32_t(w)) {
      if (work_.compare_exchange_weak(w, w + (uint64_t(1) << 32), std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
        *chunk = uint32_t(w >> 32);
        return true;
      }
    }
    return false;
  }

  // Runs chunks until none is left to claim. A claimed chunk belongs to the job in job_: the
  // caller cannot publish another before this chunk is counted as done.
  void run_claimed_chunks() {
    for (uint32_t c; claim(&c);) {
      const Job* job = job_.load(std::memory_order_relaxed);
      // Read before this chunk counts as done: the caller may return (and the job, on its
      // stack, die) the moment it does.
      const uint32_t count = job->count;
      try {
        job->invoke(job->ctx, c);
      } catch (...) {
        MutexLock lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == count) done_.notify_all();
    }
  }

  void worker_main() {
    tls_in_loop = true;
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    while (!stopping_.load(std::memory_order_acquire)) {
      run_claimed_chunks();
      if (!spin_until([&] { return epoch_.load(std::memory_order_acquire) != seen; })) {
        epoch_.wait(seen, std::memory_order_acquire);
      }
      seen = epoch_.load(std::memory_order_acquire);
    }
  }

  void start_workers() WL_REQUIRES(run_mu_) {
    stopping_.store(false, std::memory_order_release);
    for (int i = 1; i < threads(); ++i) workers_.emplace_back([this] { worker_main(); });
  }

  void stop_workers() WL_REQUIRES(run_mu_) {
    stopping_.store(true, std::memory_order_release);
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  Mutex run_mu_;  // held by the one caller using the pool
  // Written under run_mu_, read without it (an atomic: the analysis has no write-only guard).
  std::atomic<int> threads_{default_threads()};
  std::vector<std::thread> workers_ WL_GUARDED_BY(run_mu_);
  std::atomic<uint64_t> work_{0};  // (next chunk << 32) | chunk count
  std::atomic<const Job*> job_{nullptr};
  std::atomic<uint32_t> done_{0};   // chunks of the live job finished
  std::atomic<uint32_t> epoch_{0};  // bumped per job (and to stop): what idle workers wait on
  std::atomic<bool> stopping_{false};
  Mutex error_mu_;
  std::exception_ptr error_
      WL_GUARDED_BY(error_mu_);  // the first exception of the live job's chunks

  // OMP_NUM_THREADS as OpenMP programs read it, else one thread per core.
  static int default_threads() {
    if (const char* env = std::getenv("OMP_NUM_THREADS")) {
      const int n = std::atoi(env);
      if (n >= 1 && n <= kMaxThreads) return n;
    }
    return int(std::max(1u, std::thread::hardware_concurrency()));
  }
};

Pool& pool() {
  static Pool p;
  return p;
}

void pool_after_fork() { pool().forget_workers(); }

}  // namespace

void set_num_threads(int n) {
  if (n <= 0) n = int(std::max(1u, std::thread::hardware_concurrency()));
  pool().resize(std::min(n, kMaxThreads));
}

int num_threads() { return pool().threads(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int threads = tls_in_loop ? 1 : num_threads();
  const int64_t chunks = std::min((n + grain - 1) / grain, threads * kChunksPerThread);
  struct Ctx {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, chunks;
  } ctx{&fn, n, chunks};
  auto invoke = [](const void* p, int64_t c) {
    const Ctx& x = *static_cast<const Ctx*>(p);
    (*x.fn)(x.n * c / x.chunks, x.n * (c + 1) / x.chunks);
  };
  if (threads <= 1 || chunks <= 1 || !pool().try_run(uint32_t(chunks), invoke, &ctx)) fn(0, n);
}

void parallel_for_each(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  auto invoke = [](const void* p, int64_t i) {
    (*static_cast<const std::function<void(int64_t)>*>(p))(i);
  };
  if (n > 1 && n <= int64_t(UINT32_MAX) && !tls_in_loop && num_threads() > 1 &&
      pool().try_run(uint32_t(n), invoke, &fn)) {
    return;
  }
  for (int64_t i = 0; i < n; ++i) fn(i);
}

}  // namespace wl
