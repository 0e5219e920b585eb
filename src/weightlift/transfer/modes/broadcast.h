// Broadcast mode, as checkpoint-engine's broadcast update does it: the full state dict cut
// into fixed-size buckets of whole parameters, each bucket broadcast to every receiver, and
// every receiver slicing, fusing, casting or quantizing its own part out of it.
//
// Buckets. Parameters are grouped so that every receiver tensor reads from one bucket (q, k
// and v together for qkv_proj; gate and up together for gate_up_proj; the rest alone), and
// groups are packed in model order into buckets of at most `bucket_bytes` (raised to the
// largest group if that is bigger; buffers are sized to the largest bucket). A bucket holds
// its parameters' full tensors back to back, in the trainers' shard dtype (f32 or bf16:
// casting to bf16 on the sender would change what fp8 receivers quantize from).
//
// A sender's bucket must fit under UpdateOptions::watermark_bytes (ResourceExhausted on every
// rank before any byte moves otherwise).
//
// Senders. Only the first mesh sends; its mesh rank b % mesh_size owns bucket b. For each
// bucket every rank of that mesh runs full_tensor() of its parameters straight into its bucket
// buffer (collective over the mesh), then the owner broadcasts it (comm/collectives/broadcast.h, a
// pipelined chain) over a group of itself and every receiver, made once per owner.
//
// Receivers, double-buffered: two bucket buffers; bucket b arrives in buffer b % 2 while a
// converter thread turns bucket b - 1 into slot bytes (LocalConverter), so the receiving and
// the converting overlap, as checkpoint-engine overlaps its broadcast with the copy into the
// engine. The update runs in the round every mode shares (detail/update_round.h).
//
// Cost: every receiver receives the whole model in the shard dtype (2 or 4 bytes per
// parameter), whatever its own share is; p2p moves only each receiver's share.
#pragma once

#include <memory>

#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

// Collective over the world (it splits one broadcast group per owner). `shard_dtype`: what
// every trainer holds, as make_update_executor agreed.
// REQUIRES: options.mode == kBroadcast and the checks of make_update_executor passed.
Result<std::unique_ptr<UpdateExecutor>> make_broadcast_executor(ExecutorOptions options,
                                                                DType shard_dtype);

}  // namespace wl::transfer
