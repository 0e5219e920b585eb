// RowShards: a job's weights as row shards of every parameter over the job's ranks (a
// core/shard.h RowSplit per parameter), the shards a weight transfer's servers and planner read
// (transfer/layout/trainer_weights.h's OwnRows).
//
// Each parameter is split where its owners hold it when they hold it as whole rows, at most
// one run of them per rank, following one another in rank order: DDP's, ZeRO's and FSDP's own
// shards, a pipeline stage's layers, an expert group's experts, a tensor-parallel rank's band
// of output rows. Those shards are read where they lie and nothing moves; a layout of only
// such parameters (DDP, FSDP, PP, EP) is in_place(). A parameter owned otherwise (a
// tensor-parallel band of input columns, or several runs of rows on one rank as in a fused
// projection) is split by the even rule, and each rank sends every other rank the pieces of its
// own rows that fall in that rank's shards, a message per piece straight from its weights and
// (whole rows) straight into the shard: no rank ever holds more than its own rows and its
// shards, never a whole copy of the model.
//
// The exchange is planned once, from every rank's DataParallel::own_rows() (allgathered), and
// checks that the owners cover each shard once, element by element: a layout whose ownership
// overlaps or leaves a gap is an Internal error at create() on every rank, not a wrong
// transfer later.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/shard.h"
#include "weightlift/core/status.h"
#include "weightlift/parallel/data/data_parallel.h"

namespace wl::parallel {

class RowShards {
 public:
  // One parameter's shard on this rank: rows of the whole parameter, each of its full width.
  struct Shard {
    size_t param = 0;  // into ParamLayout::params()
    ShardRows rows;
    const float* data = nullptr;  // rows.size() x the width; valid until the next refresh
  };

  // Collective over `world`: every rank of `dp`'s job, ranked as the job ranks them (null for
  // one rank).
  static Result<std::unique_ptr<RowShards>> create(DataParallel& dp,
                                                   std::shared_ptr<comm::Group> world,
                                                   std::chrono::milliseconds timeout);

  // True when every rank's own rows are its shards: refresh() moves nothing and the shards
  // point into the trainer's weights.
  bool in_place() const { return in_place_; }
  // Each parameter's split over the job's ranks, in ParamLayout order (the same on every rank).
  const std::vector<RowSplit>& splits() const { return splits_; }

  // This rank's shard of every parameter that has rows on it, in ParamLayout order, from the
  // weights as they are now. Collective over the job unless in_place().
  Result<std::vector<Shard>> refresh();

  // The same shards packed back to back, as one rank sends them to another to rebuild the
  // whole model (place()). Collective as refresh() is.
  Result<std::vector<float>> refresh_packed();
  // Rank `rank`'s shards packed as refresh_packed() packs them (shard_elems(rank) floats) into
  // their places in `whole`, every parameter in ParamLayout's flat order.
  void place(int rank, const float* packed, float* whole) const;

  // The elements this rank's shards hold, and those refresh() sends to other ranks.
  int64_t shard_elems() const { return shard_elems_; }
  // The elements rank `rank`'s shards hold.
  int64_t shard_elems(int rank) const;
  int64_t sent_elems() const { return sent_elems_; }

 private:
  // A band of one parameter: rows [r0, r1) and columns [c0, c1) of its [rows, width] view.
  struct Band {
    int64_t param = 0, r0 = 0, r1 = 0, c0 = 0, c1 = 0;
    int64_t elems() const { return (r1 - r0) * (c1 - c0); }
  };
  // A band this rank sends: whole rows of its own piece `piece` (mine_), every column of it.
  struct Move {
    Band band;
    size_t piece = 0;
  };

  RowShards(DataParallel& dp, std::shared_ptr<comm::Group> world,
            std::chrono::milliseconds timeout);
  Status plan(const std::vector<std::vector<Band>>& owned);
  // splits_: where the owners hold each parameter when they can be its split, else even.
  void choose_splits(const std::vector<std::vector<Band>>& owned);
  bool owned_as_shards(const std::vector<std::vector<Band>>& owned) const;
  // Which shards are read in place (direct_) and where column bands are staged (stage_at_).
  void place_bands();
  // Where this rank's own pieces are now (InternalError if they are not those planned).
  Result<std::vector<const float*>> pieces_now();
  // `band`'s elements, row after row, into this rank's shard of its parameter.
  void unpack(const Band& band, const float* from);

  DataParallel& dp_;
  std::shared_ptr<comm::Group> world_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, ranks_ = 1;
  bool in_place_ = false;
  std::vector<RowSplit> splits_;          // per parameter
  std::vector<Band> mine_;                // this rank's own weight rows, as own_rows() orders them
  std::vector<std::vector<Move>> sends_;  // per destination rank, in packing order
  std::vector<std::vector<Band>> recvs_;  // per source rank, in packing order
  std::vector<int64_t> shard_offset_;     // per parameter, into shards_; -1 without rows here
  // Per parameter: the own piece whose rows are this rank's whole shard of it, or -1.
  std::vector<int64_t> direct_;
  // Per source rank and band received: its offset in stage_ (a band of columns), or -1
  // (received straight into its shard).
  std::vector<std::vector<int64_t>> stage_at_;
  int64_t staged_elems_ = 0;
  std::vector<float> shards_, stage_;
  int64_t shard_elems_ = 0, sent_elems_ = 0;
};

}  // namespace wl::parallel
