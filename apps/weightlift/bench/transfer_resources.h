// What `bench transfer` needs from one host, checked before it starts, and what its ranks'
// failures mean, said in one line.
//
// Many ranks on one host used to hang or crash inside UCX: its shared-memory transports keep
// buffers for every pair of ranks, so what a host needs grows with the square of the ranks
// (measured here with UCX 1.13: about 5 MB per rank and 0.5 MB per ordered pair of ranks of
// sysv segments; 220 MB for 16 ranks, 710 MB for 32), and when shared memory or address space
// runs out UCX's own error path can segfault (a failed remote-key unpack releasing what it
// never set up). So: the memory the ranks need is estimated first and refused with the
// estimate when the host lacks it (core/memory_budget.h); the job as a whole gets a deadline
// on top of every rank's own (comm/launch/launch.h), so nothing can hang past it; and a rank that
// fails is named with its last error line and, when a signal killed it, the signal.
#pragma once

#include <chrono>
#include <string>

#include "bench/transfer.h"
#include "weightlift/core/status.h"
#include "weightlift/model/config.h"

namespace wl::app {

// ResourceExhausted with the estimate when the ranks of `o` cannot fit this host: the model's
// shards, every receiver's two slots, the reference copies a verification holds, staging,
// the starting process's copy buffers, and UCX's per-rank and per-pair shared memory. Ranks
// as processes are measured against the host (a process's own limits bound each of them,
// not their sum), ranks as threads against this process.
Status check_transfer_memory(const BenchTransferOptions& o, const model::ModelConfig& c);

// The whole job's deadline: every rank waits at most --timeout for any step, and a run has
// the connection, the planning, the warm-up and each timed update to get through.
std::chrono::milliseconds transfer_job_deadline(const BenchTransferOptions& o);

// One line for a process run that ended with `code` (the launcher's), from the ranks'
// prefixed `output`: which rank failed first, how (its exit code or the signal that killed
// it) and its first error line.
Status explain_rank_failure(const std::string& output, int code);

}  // namespace wl::app
