// Expert parallelism, as the model sees it: the experts are cut into ranks() equal runs of
// consecutive experts, and rank r of the expert group runs run r over the tokens of every rank
// in the group. A block then routes and gathers its own tokens' rows as in one process, sends
// each row to its expert's rank and gets the expert's output back (two all-to-alls forward,
// two backward). The trainer's implementation is in parallel/data/data_parallel.h; a pass without
// one runs every expert itself.
//
// Each rank's rows reach an expert in rank order, after the rows of the ranks before it, so an
// expert runs the rows of a micro-batch in the order one process runs them: the same GEMMs.
#pragma once

#include <cstdint>
#include <span>

#include "weightlift/core/status.h"

namespace wl::model {

// A failed call leaves its outputs unspecified (the block uses zeros instead), and every call
// after a failure must fail at once without communicating: the block goes on calling, and a
// peer must never be handed rows it was not told to expect.
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int ranks() const = 0;  // in the expert group
  virtual int rank() const = 0;
  // send and recv hold ranks() * per_peer entries; recv[i * per_peer, (i + 1) * per_peer) =
  // what rank i sent for this rank, its block of this rank's index. Collective.
  virtual Status exchange_counts(const int64_t* send, int64_t* recv, int64_t per_peer) = 0;
  // Rows of `width` floats: send_rows[j] consecutive rows of `send` go to rank j (rank 0's
  // first), recv_rows[i] arrive from rank i into `recv`, in rank order. Collective.
  virtual Status exchange_rows(const float* send, std::span<const int64_t> send_rows, float* recv,
                               std::span<const int64_t> recv_rows, int64_t width) = 0;
};

}  // namespace wl::model
