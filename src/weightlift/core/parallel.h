// The compute thread pool.
//
// oneDNN as Debian builds it runs on OpenMP, so the OpenMP team *is* our pool: our kernels
// and oneDNN's GEMMs then share one set of threads sized once by `--threads`. A second pool of
// our own would put 2N busy threads on N cores whenever the two alternate (OpenMP workers spin
// for a while after each region), which on these 2-core machines halves GEMM speed.
#pragma once

#include <cstdint>
#include <functional>

namespace wl {

// Sets the number of compute threads (the `--threads` flag). 0 = one per core.
void set_num_threads(int n);
int num_threads();

// Runs fn(begin, end) over [0, n) split into contiguous chunks of at least `grain` items, on
// the pool. Runs inline when n <= grain or when already inside a parallel region.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace wl
