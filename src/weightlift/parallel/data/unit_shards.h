// How one unit's parameters (model/units.h), or one part of them (unit_parts.h), are cut over
// the data-parallel ranks, and packed so that one collective moves the whole of it.
//
// Every parameter is cut by core/shard.h's rule, rows on dim 0 as FSDP2 and torch.chunk do,
// so a rank's piece of a parameter is one flat range of it and a weight-transfer source or a
// distributed checkpoint can name it by rows. A rank keeps its pieces of the unit's parameters
// one after another in a packed buffer, each padded to the most rows any rank holds of that
// parameter, so that every rank's packed buffer has the same size:
//
//   unit buffer (flat layout):  [ p0 rows 0..5 | p1 rows 0..2 ]     2 ranks, 6 and 3 rows
//   packed, rank 0:             [ p0 rows 0..2 | p1 rows 0..1 ]
//   packed, rank 1:             [ p0 rows 3..5 | p1 row 2, pad ]
//
// An allgather of the packed buffers then leaves every rank's pieces side by side (rank-major),
// and unpack() puts them back in the flat layout; pack_all() is the reverse, the send buffer of
// a reduce-scatter whose result is this rank's packed gradients. Padding is zero and stays
// zero: its gradient is zero and AdamW leaves a zero weight with a zero gradient at zero.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "weightlift/core/shard.h"
#include "weightlift/model/params.h"
#include "weightlift/model/units.h"
#include "weightlift/parallel/data/unit_parts.h"

namespace wl::parallel {

struct ShardPiece {
  size_t param = 0;           // index into ParamLayout::params()
  ShardRows rows;             // this rank's rows of the parameter
  int64_t row_elems = 0;      // elements per row
  int64_t unit_offset = 0;    // where its first element is in the unit's (or part's) range
  int64_t packed_offset = 0;  // and in the rank's packed buffer
  int64_t elems() const { return rows.size() * row_elems; }
};

class UnitShards {
 public:
  UnitShards(const model::ParamLayout& layout, const model::Units& units, int unit, int ranks);
  // The parameters `params` (indices into layout.params()), which fill `range` of the flat
  // buffer in this order: one part of a unit.
  UnitShards(const model::ParamLayout& layout, std::span<const size_t> params,
             model::FlatRange range, int ranks);
  // packed_elems() without laying out any piece (a plan for a million ranks).
  static int64_t packed_elems_of(const model::ParamLayout& layout, std::span<const size_t> params,
                                 int ranks);

  int ranks() const { return ranks_; }
  int64_t unit_elems() const { return unit_elems_; }      // the unit's (or part's) range
  int64_t packed_elems() const { return packed_elems_; }  // one rank's packed buffer
  // Rank r's pieces, in the unit's parameter order (a rank may hold no rows of a parameter).
  const std::vector<ShardPiece>& pieces(int rank) const { return pieces_[size_t(rank)]; }

  // dst[packed_elems] = rank's pieces of src[unit_elems]; padding zeroed.
  void pack(const float* src, int rank, float* dst) const;
  // dst[ranks * packed_elems] = every rank's packed buffer of src, rank-major.
  void pack_all(const float* src, float* dst) const;
  // dst[unit_elems] from every rank's packed buffer in src[ranks * packed_elems], rank-major.
  void unpack_all(const float* src, float* dst) const;
  // dst[unit_elems] gets rank's pieces from src[packed_elems]; the rest of dst is untouched.
  void unpack(const float* src, int rank, float* dst) const;

 private:
  int ranks_;
  int64_t unit_elems_ = 0, packed_elems_ = 0;
  std::vector<std::vector<ShardPiece>> pieces_;  // per rank
};

// One part of a held unit (unit_parts.h) cut over the ranks it is summed over.
struct PartShards {
  const UnitPart* of = nullptr;  // the part, in the model
  UnitShards shards;
  int64_t held = 0;    // where the part starts in the unit's held buffer
  int64_t packed = 0;  // and in the unit's packed shards
  int rank = 0;        // this rank among shards.ranks()
  Over over = Over::kData;
};

// A held unit's elements: its parts' whole sizes added up.
inline int64_t held_elems(std::span<const PartShards> parts) {
  int64_t n = 0;
  for (const PartShards& p : parts) n += p.shards.unit_elems();
  return n;
}

}  // namespace wl::parallel
