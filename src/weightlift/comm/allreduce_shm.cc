// Shared-memory allreduce: reduce-scatter and allgather by loads and stores into the group's
// mapped scratch (detail/shm_arena.h), one copy of every byte that crosses a process.
//
// Why not the ring over UCX messages: on one host UCX 1.13 with peer error handling moves a
// large message through the posix transport's bounce buffer in 8 KiB fragments (sender copies
// in, receiver copies out: two copies), and CMA, its single-copy path, is left out of such
// endpoints. Here every rank maps every peer's scratch (ucp_rkey_ptr), so a rank can read what
// a peer wrote without anyone copying it again.
//
// The buffer is cut into chunks of P blocks (kShmBlockBytes each); block d of a chunk is
// reduced by rank d. Each chunk goes through three phases on every rank r:
//   1. copy in:  for every d != r, copy the input's block d into r's slot in[d]      (one copy)
//   2. reduce:   res = input block r (op) peer q's in[r] for every q, read in place from the
//                peers' scratch; then res -> output block r                  (reduce + copy)
//   3. copy out: for every d != r, copy peer d's res into output block d             (one copy)
// A phase ends by raising r's counter for it; the next phase waits for every peer's counter.
// The three phases run as a software pipeline over chunks (copy in chunk i, reduce chunk
// i-1, copy out chunk i-2), and a rank reuses a slot only once every peer's counters show that
// it has read it, so ranks drift apart by up to kShmSlots chunks without waiting. A chunk is
// small enough (P x 128 KiB) to stay in cache between the writer and the readers: the scratch
// costs cache traffic; DRAM sees the input read and the output written.
//
// Every rank reduces its blocks in the same order (its own input first, then the peers' in
// rank order), and every other rank copies that one result, so all ranks end bit-identical.
//
// Cost, n bytes over P ranks: per chunk 3 flag handoffs (about 0.1-0.3 us each between two
// cores) instead of 2(P-1) messages; per rank (P-1)/P n copied in, n/P reduced from P inputs
// and copied, (P-1)/P n copied out. With M the copy rate one rank gets while all copy:
//   T ~= [(P-1)/P n + (P+1)/2 n/P + n/P + (P-1)/P n] / M       (a reduce of k inputs ~ (k+1)/2 copies)
// For P = 2 that is 2.25 n / M. busbw = 2(P-1)/P n / T, so with M = 12 GB/s (2 ranks,
// DESIGN.md) the bound is 5.3 GB/s; the cache-resident scratch is what lets it beat that.
// docs/algorithms.md compares it with the ring.
#include <cstring>

#include "weightlift/comm/detail/allreduce_algorithms.h"
#include "weightlift/comm/detail/shm_arena.h"

namespace wl::comm::detail {

namespace {

// Element range of block b of a chunk of `n` elements cut in P near-even blocks (each at most
// block_elems; the first n % P one longer).
struct Range {
  size_t offset = 0, count = 0;
};
Range chunk_block(size_t n, int P, int b) {
  const size_t base = n / size_t(P), extra = n % size_t(P), ub = size_t(b);
  return {ub * base + std::min(ub, extra), base + (ub < extra ? 1 : 0)};
}

}  // namespace

Status allreduce_shm(Group& g, ShmArena& A, const AllreduceArgs& a, Deadline deadline) {
  if (!A.broken.ok()) return A.broken;
  const int P = g.size(), r = g.rank();
  const size_t es = dtype_size(a.dtype);
  // segment_bytes (tests make it tiny to get many chunks) can only shrink a block: the slots
  // are cut for kShmBlockBytes.
  const size_t block_bytes =
      a.segment_bytes == 0 ? A.block_bytes() : std::min(a.segment_bytes, A.block_bytes());
  const size_t block_elems = std::max<size_t>(1, block_bytes / es);
  const size_t chunk_elems = block_elems * size_t(P);
  const size_t nchunks = (a.count + chunk_elems - 1) / chunk_elems;
  const uint64_t base = A.chunks_done;
  const auto* in = static_cast<const std::byte*>(a.in);
  auto* out = static_cast<std::byte*>(a.out);
  auto chunk_n = [&](size_t c) { return std::min(chunk_elems, a.count - c * chunk_elems); };

  // Waits until every peer's `phase` counter reaches `target`.
  auto wait_for = [&](ShmPhase phase, uint64_t target, size_t c, const char* what) -> Status {
    auto lagging = [&]() -> int {
      for (int q = 0; q < P; ++q) {
        if (q != r && A.counter_of(q, phase) < target) return q;
      }
      return -1;
    };
    if (lagging() < 0) return ok_status();
    return g.poll_until(lagging, deadline,
                        "allreduce (shared memory): chunk " + std::to_string(c) + " of " +
                            std::to_string(nchunks) + ": waiting for " + what);
  };

  auto copy_in = [&](size_t c) -> Status {
    const uint64_t gc = base + c;
    const size_t slot = gc % kShmSlots;
    // Slot reuse: every peer must have reduced the chunk that used this slot before.
    if (gc >= kShmSlots) {
      WL_RETURN_IF_ERROR(wait_for(ShmPhase::kReduced, gc - kShmSlots + 1, c, "a free slot"));
    }
    const size_t n = chunk_n(c), at = c * chunk_elems;
    for (int d = 0; d < P; ++d) {
      if (d == r) continue;
      const Range b = chunk_block(n, P, d);
      if (b.count) std::memcpy(A.in_block(r, slot, d), in + (at + b.offset) * es, b.count * es);
    }
    A.publish(r, ShmPhase::kCopiedIn, gc + 1);
    return ok_status();
  };

  auto reduce_own = [&](size_t c) -> Status {
    const uint64_t gc = base + c;
    const size_t slot = gc % kShmSlots;
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedIn, gc + 1, c, "the peers' inputs"));
    if (gc >= kShmSlots) {
      WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedOut, gc - kShmSlots + 1, c, "a free slot"));
    }
    const size_t n = chunk_n(c), at = c * chunk_elems;
    const Range b = chunk_block(n, P, r);
    std::byte* res = A.res_block(r, slot);
    if (b.count) {
      const std::byte* own = in + (at + b.offset) * es;
      bool first = true;
      for (int q = 0; q < P; ++q) {
        if (q == r) continue;
        reduce(a.dtype, a.op, res, first ? own : res, A.in_block(q, slot, r), b.count);
        first = false;
      }
      if (a.op == ReduceOp::kAvg) divide(a.dtype, res, b.count, P);
      std::memcpy(out + (at + b.offset) * es, res, b.count * es);
    }
    A.publish(r, ShmPhase::kReduced, gc + 1);
    return ok_status();
  };

  auto copy_out = [&](size_t c) -> Status {
    const uint64_t gc = base + c;
    const size_t slot = gc % kShmSlots;
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kReduced, gc + 1, c, "the peers' results"));
    const size_t n = chunk_n(c), at = c * chunk_elems;
    for (int d = 0; d < P; ++d) {
      if (d == r) continue;
      const Range b = chunk_block(n, P, d);
      if (b.count) std::memcpy(out + (at + b.offset) * es, A.res_block(d, slot), b.count * es);
    }
    A.publish(r, ShmPhase::kCopiedOut, gc + 1);
    return ok_status();
  };

  Status s;
  for (size_t i = 0; i < nchunks + 2 && s.ok(); ++i) {
    if (i < nchunks) s = copy_in(i);
    if (s.ok() && i >= 1 && i - 1 < nchunks) s = reduce_own(i - 1);
    if (s.ok() && i >= 2) s = copy_out(i - 2);
  }
  if (!s.ok()) {
    A.broken = aborted(g.describe() + ": shared-memory collectives are unusable after an "
                       "earlier failure: " + s.to_string());
    return s;
  }
  A.chunks_done = base + nchunks;
  return ok_status();
}

}  // namespace wl::comm::detail
