// bench_transfer: `weightlift bench transfer`, one weight update timed again and again in one
// of the three modes (p2p: modes/p2p.h, broadcast: modes/broadcast.h, naive: modes/naive.h).
//
// Ranks are threads of this process, each with its own UCX worker (UCX moves the bytes through
// shared memory, as between processes on one host): `trainers` trainers in one FSDP mesh
// holding the preset's weights in `shard_dtype`, then `receivers` receivers, engines of `tp`.
// One metadata exchange and plan, then `updates` timed updates (after one untimed warm-up),
// each preceded by new trainer weights (untimed). After the last, every receiver is compared
// with the scalar reference (layout/reference_transform.h), untimed; `wrong` counts the tensors that differ.
//
// Reported per update (the slowest rank's wall time is the update's time):
//   total, and the split of the slowest trainer and the slowest receiver into gather (full
//   tensors), prepare (slice, fuse, cast, quantize; on receivers of broadcast and naive, the
//   conversion), write (puts, broadcasts or sends, and waiting for them) and barrier;
//   bytes sent per trainer and received per receiver (what crossed the transport), and of
//   those sent, the bytes a p2p trainer stored through a mapping of the receiver's slots
//   (shared memory on one host, modes/p2p.h) rather than put,
//   delivered bytes: what receivers hold afterwards (their slots' tensors, all receivers),
//   effective GB/s = delivered bytes / update time (decimal), peak staging bytes (largest
//   rank), and memcpy_fraction = effective GB/s / single-thread memcpy GB/s, the copy rate
//   measured at the start of the same run (best of 3 copies of a 1 GiB buffer, one thread).
// JSON (one object): mode, preset, trainers, receivers, tp, dtype, shard_dtype, updates,
// update_ms (every update), update_ms_median, update_ms_p90, split_ms (medians: trainer and
// receiver, each {gather, prepare, write, barrier}), bytes_sent (per trainer),
// bytes_received (per receiver), bytes_direct (per trainer), bytes_delivered,
// effective_gbps, memcpy_gbps, memcpy_fraction, peak_staging_bytes, watermark_bytes, wrong.
#pragma once

#include <cstddef>
#include <string>

#include "weightlift/core/status.h"

namespace wl::app {

struct BenchTransferOptions {
  std::string preset = "medium";
  int trainers = 2;   // one mesh of this many ranks
  int receivers = 2;  // receivers / tp engines
  int tp = 2;
  std::string dtype = "bf16";        // what receivers hold: bf16 or fp8
  std::string mode = "p2p";          // p2p, broadcast or naive
  std::string shard_dtype = "bf16";  // what trainers hold: bf16 (as checkpoint-engine sends) or f32
  int updates = 5;                   // timed updates, after one untimed
  size_t watermark_bytes = size_t(256) << 20;  // p2p and broadcast senders' staging bound
  size_t bucket_bytes = size_t(64) << 20;      // broadcast mode
  bool verify = true;  // compare every receiver with the reference after the last
  bool json = false;   // one JSON object instead of the table
  size_t memcpy_bytes = size_t(1) << 30;  // buffer of the memcpy measurement
};

// InvalidArgument for an unknown preset, dtype or mode and for counts that do not fit; any
// failure of the transfer itself as it happened. The naive mode's sender needs the model twice
// under its watermark; the benchmark raises the watermark for it (and reports it).
Result<std::string> bench_transfer(const BenchTransferOptions& options);

}  // namespace wl::app
