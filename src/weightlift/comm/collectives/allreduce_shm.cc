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
//                peers' scratch, written to output block r too   (reduce into two places)
//   3. copy out: for every d != r, copy peer d's res into output block d             (one copy)
// A phase ends by raising r's counter for it; the next phase waits for every peer's counter.
// The three phases run as a software pipeline over chunks (copy in chunk i, reduce chunk
// i-1, copy out chunk i-2), and a rank reuses a slot only once every peer's counters show that
// it has read it (in the phase that reads it: a reduction's inputs in phase 2, a gather's in
// phase 3, which is later), so ranks drift apart by up to kShmSlots chunks without waiting. A chunk
// is small enough (P x 128 KiB) to stay in cache between the writer and the readers: the scratch
// costs cache traffic; DRAM sees the input read and the output written.
//
// Every rank reduces its blocks in the same order (its own input first, then the peers' in
// rank order), and every other rank copies that one result, so all ranks end bit-identical.
//
// Cost, n bytes over P ranks: per chunk 3 counters raised and 2 waited for in a row (a
// cache-line hand-off between cores, about 0.1-0.3 us) instead of 2(P-1) messages; per rank
// (P-1)/P n copied in, n/P reduced from P inputs and written twice (result block and output,
// in one pass whenever either is streamed: detail/shm_kernels.h), (P-1)/P n copied out. With
// M the copy rate one rank gets while all copy, a copy costing one read and one write:
//   T ~= [(P-1)/P n + (P+2)/2 n/P + (P-1)/P n] / M       (k reads and 2 writes ~ (k+2)/2 copies)
// For P = 2 that is 2 n / M: less than that, with scratch that stays in the caches, is not
// possible for peers that can map only each other's scratch, not each other's buffers (every
// input byte a peer needs is written once to the scratch, every result byte once to it and
// once to the output). busbw = 2(P-1)/P n / T, so with M = 12 GB/s (2 ranks, DESIGN.md) the
// model gives 6 GB/s; the cache-resident scratch is what lets it beat that, since beyond the
// caches DRAM sees only the input read and the output written.
//
// Collectives whose output is 8 MiB or more write the output with non-temporal stores, which
// skip reading every output line first. Any chunked collective may write its slots so too. A
// slot line being rewritten was last read by a peer, so an ordinary store must first take the
// line back from the peer's cache. When the two cores share a cache that is cheap; when the
// machine has put them on different dies it stalled copy-in 5x and the reduction 3x (64 MiB,
// 2 ranks: 33 ms instead of 10; 1 MiB: 490 us instead of 62; docs/algorithms.md, "Where the
// slow runs came from"). A streaming store does not wait for the line, so in that mode the
// reduction streams its result to the slot from registers, and the partial sums of more than
// two ranks stay in a private block (ShmArena::staging), never shared. Its price is that the peers
// then read the slots from DRAM instead of from cache (64 MiB in 12-13 ms instead of 10 when the
// cores share a cache), so each rank measures both ways as it goes (SlotWriteChooser) and writes
// its slots the way that is cheaper at the moment. docs/algorithms.md compares all this with the
// ring.
//
// Allreduces of at most 32 KiB go one-shot instead: every rank copies its whole input into its
// slot, and after one hand-off reduces all P copies itself, in rank order (same bits on every
// rank). One hand-off instead of two in a row, which is what small messages pay for.
//
// Those of at most kShmFlaggedBytes (2 KiB) carry the hand-off in the data, as NCCL's LL128
// protocol does: every cache line a rank writes holds 56 bytes of input and the call's number,
// so a peer that sees the number has the data in the same line. The one-shot path's counter
// costs a cache miss on the peer's counter line and then one on its data line, one after the
// other, and when the machine puts the two cores on different dies each is a cross-die round
// trip (0.75-0.97 us an 8-byte allreduce in such runs, against 0.25 us). Flagged, up to 56
// bytes is one miss, and there is no counter to publish or to wait for. The writer asks for all
// its lines before it writes them, and the reader for all the peer's lines once the last one
// has its number (prefetch_for_writing/reading), so the misses overlap: 8 B to 256 B all take
// about 0.5 us, 2 KiB 0.9-1.1. At 4 KiB the one-shot path is as fast (1.7-2.0 us each): it
// reduces straight from the peers' slots, while here every line is checked and copied alone.
//
// The same pipeline, with phases left empty, serves the other collectives on one host:
//   reduce_scatter  phases 1-2; a chunk is a block-sized piece of every rank's block, and the
//                   reduction is written straight into the output
//   allgather       phase 1 puts a piece of this rank's block in its slot (the whole slot,
//                   P+1 blocks), phase 3 copies every peer's piece out: one copy per byte
//   broadcast       the root fills its slot in phase 1, the others copy it out in phase 3
// Every rank raises all three counters for every chunk, whatever the collective, so that
// collectives of different kinds follow each other on one arena.
//
// Failures: every wait is Group::poll_until (deadline, and a dead member seen through UCX's
// keepalive); after one the arena is marked broken, so later calls fail at once.
#include <emmintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "weightlift/comm/collectives/detail/allreduce_algorithms.h"
#include "weightlift/comm/collectives/detail/shm_arena.h"
#include "weightlift/comm/collectives/detail/shm_kernels.h"
#include "weightlift/core/timing.h"

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

// Buffers at least this large (bytes) are written with non-temporal stores: they are past
// what the caches can hold anyway, and a normal store would first read every output line
// from DRAM (write-allocate), a third more memory traffic for nothing.
constexpr size_t kStreamingBytes = 8 << 20;
// Allreduces up to this many bytes go one-shot: every rank copies its whole input into its
// slot and then reduces all P copies itself, in rank order (so every rank computes the same
// bits). One flag hand-off instead of two in a row; the extra reduction work is nothing at
// these sizes.
constexpr size_t kOneShotBytes = 32 << 10;

// The small allreduces move a few lines between two cores, each a cache miss that crosses
// them, and the reductions and stores that need those lines take them one after the other.
// Asking for every line first overlaps the misses (a 256-byte allreduce 0.51-0.58 us instead
// of 0.66-0.78; 2 KiB through the one-shot path 1.06-1.11 instead of 1.29-1.33).
//
// Asks for ownership of [p, p + bytes) (PREFETCHW; a no-op on the few x86-64 CPUs without
// it): the lines of a slot were last read by a peer, so each store must take its line back.
void prefetch_for_writing(std::byte* p, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 64) asm volatile("prefetchw %0" ::"m"(p[at]));
}
// Asks for a copy of [p, p + bytes): a peer's slot, just published.
void prefetch_for_reading(const std::byte* p, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
}

// After a failed wait the peers' counters and flags may be out of step with ours: later
// collectives on the arena fail at once rather than read a half-written slot. Returns `s`.
Status break_arena(Group& g, ShmArena& A, const Status& s) {
  A.broken =
      aborted(g.describe() + ": shared-memory collectives are unusable after an earlier failure: " +
              s.to_string());
  return s;
}

// One collective call on the arena: what it moves, chunk by chunk, through the three phases.
class ShmPipeline {
 public:
  ShmPipeline(Group& g, ShmArena& A, const ShmCollectiveArgs& a, Deadline deadline);
  Status run();

 private:
  size_t chunk_n(size_t c) const { return std::min(step_, a_.count - c * step_); }
  Range block(size_t c, int d) const;
  void copy_to_output(std::byte* dst, const std::byte* src, size_t bytes) const {
    copy_bytes(dst, src, bytes, streaming_);
  }
  SlotWriteChooser& chooser() const { return A_.slot_writes[int(a_.kind)][streaming_ ? 1 : 0]; }
  // Streaming stores are not ordered with the release store that publishes a phase.
  void fence_before_publish(size_t slot) const {
    if (streaming_ || stream_slot_[slot]) _mm_sfence();
  }
  Status wait_for(ShmPhase phase, uint64_t target, size_t c, const char* what, int only = -1);
  Status copy_in(size_t c);
  Status reduce_own(size_t c);
  Status copy_out(size_t c);
  void reduce_one_shot(size_t c, size_t slot);

  Group& g_;
  ShmArena& A_;
  const ShmCollectiveArgs& a_;
  const Deadline deadline_;
  const int P_, r_;
  const size_t es_;
  bool one_shot_ = false;  // a small allreduce moved as an allgather, reduced by every rank
  ShmKind kind_;           // what moves: a.kind, or kAllgather for one_shot
  bool reduces_ = false;
  size_t step_ = 0;  // elements per chunk
  size_t nchunks_ = 0;
  uint64_t base_ = 0;  // the arena's chunk count before this call
  const std::byte* in_;
  std::byte* out_;
  bool streaming_ = false;
  // By slot: whether this rank streamed the chunk's slot writes, and its copy-in time.
  bool stream_slot_[kShmSlots] = {};
  double copy_in_seconds_[kShmSlots] = {};
};

ShmPipeline::ShmPipeline(Group& g, ShmArena& A, const ShmCollectiveArgs& a, Deadline deadline)
    : g_(g),
      A_(A),
      a_(a),
      deadline_(deadline),
      P_(g.size()),
      r_(g.rank()),
      es_(dtype_size(a.dtype)),
      kind_(a.kind),
      in_(static_cast<const std::byte*>(a.in)),
      out_(static_cast<std::byte*>(a.out)) {
  // segment_bytes (tests make it tiny to get many chunks) can only shrink a block: the slots
  // are cut for kShmBlockBytes.
  const size_t block_bytes =
      a.segment_bytes == 0 ? A.block_bytes() : std::min(a.segment_bytes, A.block_bytes());
  const size_t block_elems = std::max<size_t>(1, block_bytes / es_);
  one_shot_ = a.kind == ShmKind::kAllreduce && a.count * es_ <= kOneShotBytes &&
              a.count <= block_elems * (size_t(P_) + 1);
  if (one_shot_) kind_ = ShmKind::kAllgather;
  reduces_ = kind_ == ShmKind::kAllreduce || kind_ == ShmKind::kReduceScatter;
  // Elements per chunk: allreduce cuts a chunk of the buffer into P blocks; reduce_scatter
  // takes a block-sized piece of every rank's block; allgather and broadcast fill a whole slot
  // (P+1 blocks) with one rank's piece.
  step_ = kind_ == ShmKind::kAllreduce       ? block_elems * size_t(P_)
          : kind_ == ShmKind::kReduceScatter ? block_elems
                                             : block_elems * (size_t(P_) + 1);
  nchunks_ = (a.count + step_ - 1) / step_;
  base_ = A.chunks_done;
  if (!reduces_) A.read_in_copy_out_until = base_ + nchunks_;
  const size_t out_bytes = (a.kind == ShmKind::kAllgather ? size_t(P_) : 1) * a.count * es_;
  streaming_ = out_bytes >= kStreamingBytes;
}

// Element range of block d of chunk c, in the input (allreduce, reduce_scatter).
Range ShmPipeline::block(size_t c, int d) const {
  if (kind_ == ShmKind::kAllreduce) {
    const Range b = chunk_block(chunk_n(c), P_, d);
    return {c * step_ + b.offset, b.count};
  }
  return {size_t(d) * a_.count + c * step_, chunk_n(c)};
}

// Waits until the `phase` counter of every peer (or only of `only`) reaches `target`.
Status ShmPipeline::wait_for(ShmPhase phase, uint64_t target, size_t c, const char* what,
                             int only) {
  auto lagging = [&]() -> int {
    for (int q = 0; q < P_; ++q) {
      if (q != r_ && (only < 0 || q == only) && A_.counter_of(q, phase) < target) return q;
    }
    return -1;
  };
  if (lagging() < 0) return ok_status();
  return g_.poll_until(lagging, deadline_, [&] {
    return std::string(shm_kind_name(a_.kind)) + " (shared memory): chunk " + std::to_string(c) +
           " of " + std::to_string(nchunks_) + ": waiting for " + what;
  });
}

// Phase 1: put what peers need from this rank into its slot.
Status ShmPipeline::copy_in(size_t c) {
  const uint64_t gc = base_ + c;
  const size_t slot = gc % kShmSlots;
  if (reduces_) {
    // Slot reuse: every peer must be done reading the chunk that used this slot before, which
    // a reducing collective reads while reducing and a gathering one while copying out.
    if (gc >= kShmSlots) {
      const uint64_t before = gc - kShmSlots;
      const ShmPhase read =
          before < A_.read_in_copy_out_until ? ShmPhase::kCopiedOut : ShmPhase::kReduced;
      WL_RETURN_IF_ERROR(wait_for(read, before + 1, c, "a free slot"));
    }
    const bool stream = stream_slot_[slot] = chooser().stream(gc);
    const Stopwatch clock;
    for (int d = 0; d < P_; ++d) {
      const Range b = block(c, d);
      if (d != r_ && b.count) {
        copy_bytes(A_.in_block(r_, slot, d), in_ + b.offset * es_, b.count * es_, stream);
      }
    }
    copy_in_seconds_[slot] = clock.seconds();  // recorded with the reduction's time
  } else if (kind_ == ShmKind::kAllgather || r_ == a_.root) {
    // The whole slot carries this rank's piece; every peer must have copied it out before.
    if (gc >= kShmSlots) {
      WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedOut, gc - kShmSlots + 1, c, "a free slot"));
    }
    const size_t n = chunk_n(c);
    if (one_shot_) {  // small: no clock, no choice
      prefetch_for_writing(A_.in_block(r_, slot, 0), n * es_);
      std::memcpy(A_.in_block(r_, slot, 0), in_ + c * step_ * es_, n * es_);
    } else {
      const bool stream = stream_slot_[slot] = chooser().stream(gc);
      const Stopwatch clock;
      copy_bytes(A_.in_block(r_, slot, 0), in_ + c * step_ * es_, n * es_, stream);
      chooser().record(stream, clock.seconds() / double(n * es_));
    }
    std::byte* mine = out_ + (size_t(r_) * a_.count + c * step_) * es_;
    if (!one_shot_ && kind_ == ShmKind::kAllgather && mine != in_ + c * step_ * es_) {
      copy_to_output(mine, in_ + c * step_ * es_, n * es_);
    }
  }
  fence_before_publish(slot);
  A_.publish(r_, ShmPhase::kCopiedIn, gc + 1);
  return ok_status();
}

// Phase 2: reduce this rank's block from every rank's copy (allreduce, reduce_scatter).
Status ShmPipeline::reduce_own(size_t c) {
  const uint64_t gc = base_ + c;
  const size_t slot = gc % kShmSlots;
  if (reduces_) {
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedIn, gc + 1, c, "the peers' inputs"));
    if (kind_ == ShmKind::kAllreduce && gc >= kShmSlots) {
      WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedOut, gc - kShmSlots + 1, c, "a free slot"));
    }
    const Range b = block(c, r_);
    const Stopwatch clock;
    if (b.count) {
      // Every step but the last adds into the private staging block; the last writes the
      // result where it goes. allreduce: the result block, which the peers copy, and the
      // output at once; reduce_scatter: the output.
      const int last = r_ == P_ - 1 ? P_ - 2 : P_ - 1;  // the last peer in rank order
      const std::byte* sum = in_ + b.offset * es_;      // our own input first
      for (int q = 0; q < last; ++q) {
        if (q == r_) continue;
        reduce(a_.dtype, a_.op, A_.staging.data(), sum, A_.in_block(q, slot, r_), b.count);
        sum = A_.staging.data();
      }
      ReduceDestination first{out_ + c * step_ * es_, streaming_}, second;
      if (kind_ == ShmKind::kAllreduce) {
        first = {A_.res_block(r_, slot), stream_slot_[slot]};
        second = {out_ + b.offset * es_, streaming_};
      }
      reduce_to(a_.dtype, a_.op, first, second, sum, A_.in_block(last, slot, r_), b.count, P_);
    }
    chooser().record(stream_slot_[slot],
                     (copy_in_seconds_[slot] + clock.seconds()) / double(chunk_n(c) * es_));
  }
  fence_before_publish(slot);
  A_.publish(r_, ShmPhase::kReduced, gc + 1);
  return ok_status();
}

// One-shot allreduce: every rank's copy, our own included (the output may be our input),
// reduced in rank order, so every rank computes the same bits.
void ShmPipeline::reduce_one_shot(size_t c, size_t slot) {
  const size_t n = chunk_n(c);
  for (int q = 0; q < P_; ++q) {
    if (q != r_) prefetch_for_reading(A_.in_block(q, slot, 0), n * es_);
  }
  std::byte* dst = out_ + c * step_ * es_;
  reduce(a_.dtype, a_.op, dst, A_.in_block(0, slot, 0), A_.in_block(1, slot, 0), n);
  for (int q = 2; q < P_; ++q) reduce(a_.dtype, a_.op, dst, dst, A_.in_block(q, slot, 0), n);
  if (a_.op == ReduceOp::kAvg) divide(a_.dtype, dst, n, P_);
}

// Phase 3: copy what the peers made available into the output.
Status ShmPipeline::copy_out(size_t c) {
  const uint64_t gc = base_ + c;
  const size_t slot = gc % kShmSlots;
  if (kind_ == ShmKind::kAllreduce) {
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kReduced, gc + 1, c, "the peers' results"));
    for (int d = 0; d < P_; ++d) {
      const Range b = block(c, d);
      if (d != r_ && b.count)
        copy_to_output(out_ + b.offset * es_, A_.res_block(d, slot), b.count * es_);
    }
  } else if (one_shot_) {
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedIn, gc + 1, c, "the peers' inputs"));
    reduce_one_shot(c, slot);
  } else if (kind_ == ShmKind::kAllgather) {
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedIn, gc + 1, c, "the peers' blocks"));
    for (int d = 0; d < P_; ++d) {
      if (d == r_) continue;
      copy_to_output(out_ + (size_t(d) * a_.count + c * step_) * es_, A_.in_block(d, slot, 0),
                     chunk_n(c) * es_);
    }
  } else if (kind_ == ShmKind::kBroadcast && r_ != a_.root) {
    WL_RETURN_IF_ERROR(wait_for(ShmPhase::kCopiedIn, gc + 1, c, "the root's data", a_.root));
    copy_to_output(out_ + c * step_ * es_, A_.in_block(a_.root, slot, 0), chunk_n(c) * es_);
  }
  A_.publish(r_, ShmPhase::kCopiedOut, gc + 1);
  return ok_status();
}

// The software pipeline: copy in chunk i, reduce chunk i-1, copy out chunk i-2.
Status ShmPipeline::run() {
  Status s;
  for (size_t i = 0; i < nchunks_ + 2 && s.ok(); ++i) {
    if (i < nchunks_) s = copy_in(i);
    if (s.ok() && i >= 1 && i - 1 < nchunks_) s = reduce_own(i - 1);
    if (s.ok() && i >= 2) s = copy_out(i - 2);
  }
  if (streaming_) _mm_sfence();  // the output is complete before the caller reads it
  if (!s.ok()) return break_arena(g_, A_, s);
  A_.chunks_done = base_ + nchunks_;
  return ok_status();
}

// The flagged allreduce (at most kShmFlaggedBytes; the top of the file says why). A rank
// writes its input in lines of kFlaggedLineData bytes, each followed in its cache line by the
// call's number, stored after the data with release order. A peer waits for the last line's
// number (x86 makes stores visible in program order, so all lines are there then) and copies
// every line, checking each one's number. Waiting on one line, not each in turn, keeps the
// reader off lines the writer is still filling: polling them one by one bounced each line
// between the two cores (22 us for 4 KiB, measured, against 2.2 us OpenMPI's).
//
// Call k writes flagged buffer k % 2, last written by call k - 2: every peer finished reading
// that before it wrote call k - 1's lines, which this rank has read, so no slot needs freeing.
// The P inputs are gathered whole, then reduced in rank order as the one-shot path does, so
// every rank computes the same bits.
constexpr size_t kFlaggedLineData = 56;  // and an 8-byte call number: one 64-byte line

Status allreduce_flagged(Group& g, ShmArena& A, const AllreduceArgs& a, Deadline deadline) {
  const int P = g.size(), r = g.rank();
  const size_t bytes = a.count * dtype_size(a.dtype);
  const size_t lines = (bytes + kFlaggedLineData - 1) / kFlaggedLineData;
  const uint64_t call = ++A.flagged_calls;  // the buffers start at 0, no call's number
  const uint64_t which = call % 2;
  const auto* in = static_cast<const std::byte*>(a.in);
  std::byte* gathered = A.flagged_inputs.data();
  auto number = [](std::byte* line) {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(line + kFlaggedLineData));
  };
  // A line's data; whole lines with a constant size, which the compiler turns into a few
  // vector moves instead of a call to memcpy (37 lines for 2 KiB, on each side).
  auto copy_line = [&](std::byte* dst, const std::byte* src, size_t i) {
    if (i + 1 < lines) {
      std::memcpy(dst, src, kFlaggedLineData);
    } else {
      std::memcpy(dst, src, bytes - i * kFlaggedLineData);
    }
  };

  std::memcpy(gathered + size_t(r) * kShmFlaggedBytes, in, bytes);
  std::byte* mine = A.flagged_lines(r, which);
  prefetch_for_writing(mine, 64 * lines);
  for (size_t i = 0; i < lines; ++i) {
    copy_line(mine + 64 * i, in + i * kFlaggedLineData, i);
    number(mine + 64 * i).store(call, std::memory_order_release);
  }

  int q = r == 0 ? 1 : 0;  // the next peer to read, in rank order
  auto lagging = [&]() -> int {
    for (; q < P; q += q + 1 == r ? 2 : 1) {
      std::byte* theirs = A.flagged_lines(q, which);
      if (number(theirs + 64 * (lines - 1)).load(std::memory_order_acquire) != call) return q;
      prefetch_for_reading(theirs, 64 * (lines - 1));
      for (size_t i = 0; i < lines; ++i) {
        if (number(theirs + 64 * i).load(std::memory_order_acquire) != call) return q;
        copy_line(gathered + size_t(q) * kShmFlaggedBytes + i * kFlaggedLineData, theirs + 64 * i,
                  i);
      }
    }
    return -1;
  };
  if (lagging() >= 0) {
    Status s = g.poll_until(lagging, deadline, [&] {
      return "allreduce (shared memory, " + std::to_string(bytes) +
             " bytes in flagged lines): waiting for the peers' inputs";
    });
    if (!s.ok()) return break_arena(g, A, s);
  }

  auto* out = static_cast<std::byte*>(a.out);
  reduce(a.dtype, a.op, out, gathered, gathered + kShmFlaggedBytes, a.count);
  for (int k = 2; k < P; ++k) {
    reduce(a.dtype, a.op, out, out, gathered + size_t(k) * kShmFlaggedBytes, a.count);
  }
  if (a.op == ReduceOp::kAvg) divide(a.dtype, out, a.count, P);
  return ok_status();
}

}  // namespace

Status shm_collective(Group& g, ShmArena& A, const ShmCollectiveArgs& a, Deadline deadline) {
  if (!A.broken.ok()) return A.broken;
  return ShmPipeline(g, A, a, deadline).run();
}

const char* shm_kind_name(ShmKind kind) {
  static const char* const kNames[] = {"allreduce", "reduce_scatter", "allgather", "broadcast"};
  return kNames[int(kind)];
}

Status allreduce_shm(Group& g, ShmArena& A, const AllreduceArgs& a, Deadline deadline) {
  if (!A.broken.ok()) return A.broken;
  // segment_bytes (tests) asks for the chunked pipeline at a size of its own.
  if (a.count * dtype_size(a.dtype) <= kShmFlaggedBytes && a.segment_bytes == 0) {
    return allreduce_flagged(g, A, a, deadline);
  }
  return shm_collective(g, A,
                        {.kind = ShmKind::kAllreduce,
                         .in = a.in,
                         .out = a.out,
                         .count = a.count,
                         .dtype = a.dtype,
                         .op = a.op,
                         .segment_bytes = a.segment_bytes},
                        deadline);
}

}  // namespace wl::comm::detail
