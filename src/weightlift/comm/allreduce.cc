// allreduce(): validation and the choice of algorithm.
//
// The choice follows the alpha-beta-gamma model of docs/algorithms.md: alpha per message
// step, beta per byte moved between ranks, gamma per byte reduced. For n bytes on P ranks
// (L = ceil(log2 P), and two extra whole-buffer steps when P is not a power of two):
//   ring:               2(P-1) alpha + 2(P-1)/P n beta + (P-1)/P n gamma
//   recursive doubling: L alpha + L n beta + L n gamma        (+ 2 alpha + 2 n beta + n gamma)
// Recursive doubling wins while the buffer is small enough that latency dominates.
#include "weightlift/comm/allreduce.h"

#include <cmath>
#include <cstring>

#include "weightlift/comm/detail/allreduce_algorithms.h"
#include "weightlift/comm/detail/shm_arena.h"
#include "weightlift/comm/detail/validate.h"

namespace wl::comm {

namespace {

// Constants of the model, measured on the machines DESIGN.md describes (2 ranks, UCX over
// shared memory): a small tagged message round costs about 2 us; moving a byte through the
// shared-memory transport about 1/6 ns (two copies at ~12 GB/s each); reducing an f32 byte
// (two reads, one write) about 1/10 ns.
constexpr double kAlphaSeconds = 2e-6;
constexpr double kBetaSecondsPerByte = 1.0 / 6e9;
constexpr double kGammaSecondsPerByte = 1.0 / 10e9;

double ring_cost(double n, int p) {
  const double frac = double(p - 1) / double(p);
  return 2.0 * (p - 1) * kAlphaSeconds + 2.0 * frac * n * kBetaSecondsPerByte +
         frac * n * kGammaSecondsPerByte;
}

double recursive_doubling_cost(double n, int p) {
  const int levels = int(std::floor(std::log2(double(p))));
  const bool pow2 = (p & (p - 1)) == 0;
  double t = levels * (kAlphaSeconds + n * (kBetaSecondsPerByte + kGammaSecondsPerByte));
  if (!pow2) t += 2.0 * (kAlphaSeconds + n * kBetaSecondsPerByte) + n * kGammaSecondsPerByte;
  return t;
}

}  // namespace

AllreduceAlgorithm choose_allreduce_algorithm(size_t bytes, int ranks) {
  if (ranks <= 1) return AllreduceAlgorithm::kRecursiveDoubling;
  return recursive_doubling_cost(double(bytes), ranks) <= ring_cost(double(bytes), ranks)
             ? AllreduceAlgorithm::kRecursiveDoubling
             : AllreduceAlgorithm::kRing;
}

Status allreduce(Group& g, const AllreduceOptions& o) {
  const uint32_t sequence = g.next_sequence();
  WL_RETURN_IF_ERROR(detail::check_reduction(g, "allreduce", o.dtype, o.op));
  WL_RETURN_IF_ERROR(detail::check_buffer(g, "allreduce", "recv", o.recv, o.count));
  if (o.count == 0) return ok_status();
  const void* in = o.send != nullptr ? o.send : o.recv;
  if (g.size() == 1) {
    if (in != o.recv) std::memmove(o.recv, in, o.count * dtype_size(o.dtype));
    return ok_status();
  }
  const detail::AllreduceArgs args{.in = in,
                                   .out = o.recv,
                                   .count = o.count,
                                   .dtype = o.dtype,
                                   .op = o.op,
                                   .segment_bytes = o.segment_bytes,
                                   .sequence = sequence};
  const Deadline deadline = g.deadline(o.timeout);
  AllreduceAlgorithm algo = o.algorithm;
  if (algo == AllreduceAlgorithm::kAuto || algo == AllreduceAlgorithm::kSharedMemory) {
    // The first call on a group sets up its arena (collectively: every rank gets here).
    WL_ASSIGN_OR_RETURN(detail::ShmArena * arena, detail::shm_arena(g, deadline));
    if (arena != nullptr) return detail::allreduce_shm(g, *arena, args, deadline);
    algo = choose_allreduce_algorithm(o.count * dtype_size(o.dtype), g.size());
  }
  return algo == AllreduceAlgorithm::kRing
             ? detail::allreduce_ring(g, args, deadline)
             : detail::allreduce_recursive_doubling(g, args, deadline);
}

}  // namespace wl::comm
