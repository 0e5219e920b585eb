// The p2p mode: replays a plan after each training step, every receiver getting exactly its
// own bytes by one-sided puts straight into its registered weight slot (seed 000).
//
// One update, inside the round every mode shares (detail/update_round.h: the start handshake,
// whose refusals include a watermark below required_watermark(), and the closing barrier):
//   0. maxima    a mesh that splits fp8 bands across its ranks (plan/planner.h) first reads
//                 the block maxima of each rank's sub-bands and allreduces them (max), once
//                 per update, before any put
//   1. per sender, its tasks through seed 000's stages, as a queue:
//        load     offloaded shards: the rows a task reads copied out of the offload buffer
//        prepare  slice, fuse, cast or fp8-quantize (a sub-band with its band's shared
//                 scales) into a staging buffer (detail/prepare.h)
//        write    one-sided put(s) into the receiver's slot for version v+1; not waited for,
//                 so the next task is prepared while this one is on the wire. When the
//                 receiver's slots are in shared memory this process can map (same host:
//                 UCX's rkey_ptr, as comm's shared-memory collectives use), the write is a
//                 store through that mapping instead, and prepare writes its output there
//                 directly: one copy per byte, no staging, no puts. (UCX 1.13 leaves CMA out
//                 of endpoints with peer error handling, so a put on one host is emulated
//                 with 8 KiB active messages: two copies, the second by the receiver.)
//        complete puts are retired oldest first when staging would pass the watermark, then
//                 all of them, then a flush per receiver
//      Staging bytes (loads, f32 scratch and staged outputs) never pass
//      the watermark: a task starts only when it fits beside what is in flight.
//      bf16 tasks that read one contiguous bf16 shard range need no staging: they are put
//      (or copied into the mapping) straight from the shard (zero copy).
//   2. checksums  (optional) each sender sends each receiver one 64-bit checksum per task;
//                 the receiver verifies what landed in its slot, and a mismatch fails the
//                 round (DataLoss naming the tensor, rows and sender). A sender that failed
//                 sends the message all the same, saying so in its first word, so that no
//                 receiver waits out its deadline for checksums that will never come; the
//                 closing barrier then fails the round naming that sender.
// A sender connects to its receivers and unpacks their rkeys at its first update, once the
// start has shown their epochs current and their processes alive.
#pragma once

#include <memory>

#include "weightlift/transfer/modes/update_executor.h"

namespace wl::transfer {

// REQUIRES: options.mode == kP2P and the checks of make_update_executor passed.
Result<std::unique_ptr<UpdateExecutor>> make_p2p_executor(ExecutorOptions options);

}  // namespace wl::transfer
