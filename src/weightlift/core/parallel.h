// The compute thread pool: every parallel loop of the kernels, and oneDNN's GEMMs (which
// kernels/gemm.cc cuts into tiles and runs single-threaded on the pool), go through it.
//
// Built for machines that other people use too. A loop is cut into more chunks than there are
// threads, and the threads (the caller among them) claim chunks one at a time from a shared
// counter, so a thread that loses its core to another process for a while simply claims fewer.
// A loop ends when its chunks are done, not when every thread has checked in: a worker that
// has not woken up yet delays nothing. Idle workers wait for the next loop for a millisecond,
// yielding their core to anyone who wants it, then sleep in the kernel, so they never hold a
// core that the thread doing the work (or a neighbour) needs. OpenMP's teams did the opposite on
// all three counts (fixed ranges, a barrier for everyone, spinning waits), and a busy neighbour
// made our training step 3x slower (docs/BENCHMARKS.md).
//
// Calls from several threads at once are safe: one caller uses the pool, the others run their
// loop on their own thread (as do loops nested inside a pool task). An exception thrown by a
// chunk is rethrown to the caller once every chunk has finished.
#pragma once

#include <cstdint>
#include <functional>

namespace wl {

// Sets the number of compute threads (the `--threads` flag), the caller included.
// 0 = one per core. REQUIRES: no parallel loop is running.
void set_num_threads(int n);
int num_threads();

// Runs fn(begin, end) over [0, n) split into contiguous chunks of at least `grain` items (up
// to a few per thread). Runs inline when n <= grain or when no other thread can help.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Runs fn(i) for every i in [0, n), each i claimed on its own: for units of work that are
// large and uneven, put the expensive ones first.
void parallel_for_each(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace wl
