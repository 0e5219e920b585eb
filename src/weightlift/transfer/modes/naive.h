// Naive mode, the baseline that simple setups use: the first trainer gathers the whole state
// dict (full_tensor() of every parameter, collective over its mesh), serialises it to
// safetensors bytes in memory, and sends the blob to each receiver in turn as one tagged
// message; each receiver deserialises it (SafetensorsFile::parse, every header check) and
// converts its own part into its slot (LocalConverter), all of it after the last byte arrived.
//
// Cost: the sender holds the model twice (tensors and blob) and sends it once per receiver,
// serially; no stage overlaps another. The update runs in the round every mode shares
// (detail/update_round.h); the watermark must hold the sender's two copies of the model and
// 256 bytes of header per tensor (ResourceExhausted on every rank otherwise).
//
// Wire: per receiver, a little-endian u64 blob length (user tag 0x7c6), then the blob (user tag
// 0x7c7): a safetensors file (docs/formats.md) whose tensors are the parameters in model order,
// in the trainers' shard dtype, with metadata {"format": "weightlift-naive-update",
// "version": "<weight version>"}; the receiver refuses another version (DataLoss).
#pragma once

#include <memory>

#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

// `shard_dtype`: what every trainer holds, as make_update_executor agreed.
// REQUIRES: options.mode == kNaive and the checks of make_update_executor passed.
Result<std::unique_ptr<UpdateExecutor>> make_naive_executor(ExecutorOptions options,
                                                            DType shard_dtype);

}  // namespace wl::transfer
