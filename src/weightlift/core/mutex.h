// A mutex that clang's thread-safety analysis understands (-Wthread-safety, the clang-tsa
// build preset): members say which mutex guards them and functions which they need held, and
// the compiler checks every access. libstdc++'s std::mutex carries no such annotations.
//
//   class Queue {
//     Mutex mu_;
//     std::deque<int> items_ WL_GUARDED_BY(mu_);
//     void push(int x) WL_EXCLUDES(mu_) { MutexLock lock(mu_); items_.push_back(x); }
//   };
//
// GCC ignores the annotations. A CondVar waits on a MutexLock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define WL_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define WL_THREAD_ANNOTATION(x)
#endif

#define WL_CAPABILITY(x) WL_THREAD_ANNOTATION(capability(x))
#define WL_SCOPED_CAPABILITY WL_THREAD_ANNOTATION(scoped_lockable)
#define WL_GUARDED_BY(x) WL_THREAD_ANNOTATION(guarded_by(x))
#define WL_PT_GUARDED_BY(x) WL_THREAD_ANNOTATION(pt_guarded_by(x))
#define WL_REQUIRES(...) WL_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define WL_ACQUIRE(...) WL_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define WL_RELEASE(...) WL_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define WL_EXCLUDES(...) WL_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define WL_TRY_ACQUIRE(...) WL_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define WL_NO_THREAD_SAFETY_ANALYSIS WL_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace wl {

class WL_CAPABILITY("mutex") Mutex {
 public:
  void lock() WL_ACQUIRE() { mu_.lock(); }
  void unlock() WL_RELEASE() { mu_.unlock(); }
  // Takes the mutex if no one holds it; true if it did.
  bool try_lock() WL_TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope.
class WL_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) WL_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  // Takes over `mu`, already held (after a successful try_lock).
  MutexLock(Mutex& mu, std::adopt_lock_t) WL_REQUIRES(mu) : mu_(mu) {}
  ~MutexLock() WL_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  friend class CondVar;
  Mutex& mu_;
};

// std::condition_variable over a Mutex. The analysis sees the mutex held throughout a wait
// (it is released and re-acquired inside, as with any condition variable).
class CondVar {
 public:
  void notify_one() { cv_.notify_one(); }
  void notify_all() { cv_.notify_all(); }
  // Waits until pred() holds; pred runs with the mutex held.
  template <class Pred>
  void wait(MutexLock& lock, Pred pred) {
    std::unique_lock<std::mutex> l(lock.mu_.mu_, std::adopt_lock);
    cv_.wait(l, pred);
    l.release();
  }
  // As wait, until `deadline`; returns pred() at the end.
  template <class Clock, class Duration, class Pred>
  bool wait_until(MutexLock& lock, std::chrono::time_point<Clock, Duration> deadline, Pred pred) {
    std::unique_lock<std::mutex> l(lock.mu_.mu_, std::adopt_lock);
    const bool ok = cv_.wait_until(l, deadline, pred);
    l.release();
    return ok;
  }

 private:
  std::condition_variable cv_;
};

}  // namespace wl
