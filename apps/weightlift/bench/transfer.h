// `weightlift bench transfer`: one weight update timed again and again in one of the three
// modes (transfer/modes/update_executor.h).
//
// Ranks are separate processes by default, as a user runs them and as the PyTorch/gloo
// baseline runs its own: the command starts `trainers + receivers` copies of itself with
// comm::run_launch (torchrun's variables, one job token), each a rank with its own UCX worker
// (shared memory between processes on one host). With `threads`, the ranks are threads of
// this process instead (each still with its own worker), as the benchmark first measured;
// the output says which. Trainers form one FSDP mesh holding the preset's weights in
// `shard_dtype`; receivers are engines of `tp`. One metadata exchange and plan, then
// `updates` timed updates (after one untimed warm-up), each preceded by new trainer weights
// (untimed). After the last, every receiver is compared with the scalar reference
// (transfer/layout/reference_transform.h), untimed; `wrong` counts the tensors that differ.
//
// Reported per update (the slowest rank's wall time is the update's time):
//   total, and the split of the slowest trainer and the slowest receiver into gather (full
//   tensors), prepare (slice, fuse, cast, quantize; on receivers of broadcast and naive, the
//   conversion), write (puts, broadcasts or sends, and waiting for them) and barrier;
//   bytes sent per trainer and received per receiver (what crossed the transport), and of
//   those sent, the bytes a p2p trainer stored through a mapping of the receiver's slots
//   (shared memory on one host, transfer/modes/p2p.h) rather than put,
//   delivered bytes: what receivers hold afterwards (their slots' tensors, all receivers),
//   effective GB/s = delivered bytes / update time (decimal), peak staging bytes (largest
//   rank), and memcpy_fraction = effective GB/s / single-thread memcpy GB/s, the copy rate
//   measured at the start of the same run, before any rank starts (best of 3 copies of a
//   1 GiB buffer, one thread).
// JSON (one object): ranks ("processes" or "threads"), mode, preset, trainers, mesh_size,
// receivers, tp,
// dtype, shard_dtype, updates, update_ms (every update), update_ms_p50, update_ms_p99,
// split_ms (p50s: trainer and receiver, each {gather, prepare, write, barrier}), bytes_sent
// (per trainer), bytes_received (per receiver), bytes_direct (per trainer), bytes_delivered,
// effective_gbps, memcpy_gbps, memcpy_fraction, peak_staging_bytes, watermark_bytes, wrong.
#pragma once

#include <cstddef>
#include <string>

#include "weightlift/core/dtype.h"
#include "weightlift/core/status.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/modes/update_executor.h"

namespace wl::app {

struct BenchTransferOptions {
  std::string preset = "medium";
  std::string model_dir;  // a Hugging Face checkpoint's shapes instead of the preset's
  int trainers = 2;       // trainer ranks, in meshes of mesh_size
  int mesh_size = 0;      // ranks per FSDP mesh, each a replica of the model; 0: trainers
  int receivers = 2;      // receivers / tp engines
  int tp = 2;
  transfer::WeightFormat format = transfer::WeightFormat::kBF16;  // what receivers hold
  transfer::TransferMode mode = transfer::TransferMode::kP2P;
  DType shard_dtype = DType::kBF16;  // what trainers hold: bf16 (as checkpoint-engine sends) or f32
  int updates = 5;                   // timed updates, after one untimed
  size_t watermark_bytes = size_t(256) << 20;  // p2p and broadcast senders' staging bound
  size_t bucket_bytes = size_t(64) << 20;      // broadcast mode
  bool verify = true;    // compare every receiver with the reference after the last
  bool json = false;     // one JSON object instead of the table
  bool threads = false;  // ranks as threads of this process instead of processes
  size_t memcpy_bytes = size_t(1) << 30;  // buffer of the memcpy measurement
  int timeout_s = 300;                    // every wait of every rank
};

// The whole benchmark: checks the options, measures the copy rate, runs the ranks (processes
// or threads) and returns the report or its JSON. InvalidArgument for an unknown preset and
// counts that do not fit; any rank's failure as it happened (naming the rank). The naive
// mode's sender needs the model twice under its watermark; the benchmark raises the watermark
// for it (and reports it).
Result<std::string> bench_transfer(const BenchTransferOptions& options);

// One rank of a process run, started by bench_transfer with the launcher's variables set:
// connects the world, runs its part and, on rank 0, returns the report (empty elsewhere).
// `memcpy_gbps`: the copy rate the starting process measured.
Result<std::string> bench_transfer_rank(const BenchTransferOptions& options, double memcpy_gbps);

}  // namespace wl::app
