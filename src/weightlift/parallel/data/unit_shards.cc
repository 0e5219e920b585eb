// unit_shards.h.
#include "weightlift/parallel/data/unit_shards.h"

#include <cstring>

#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"

namespace wl::parallel {
namespace {

int64_t row_elems_of(const Shape& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// Copies every piece of `ps` between the unit's flat layout and a packed buffer, pieces in
// parallel (each is one contiguous block).
void copy_pieces(const std::vector<ShardPiece>& ps, const float* src, float* dst, bool to_packed) {
  parallel_for(int64_t(ps.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const ShardPiece& p = ps[size_t(i)];
      const size_t bytes = size_t(p.elems()) * sizeof(float);
      if (to_packed) {
        std::memcpy(dst + p.packed_offset, src + p.unit_offset, bytes);
      } else {
        std::memcpy(dst + p.unit_offset, src + p.packed_offset, bytes);
      }
    }
  });
}

}  // namespace

int64_t UnitShards::packed_elems_of(const model::ParamLayout& layout,
                                    std::span<const size_t> params, int ranks) {
  int64_t packed = 0;
  for (size_t index : params) {
    const Shape& shape = layout.params()[index].shape;
    packed += shard_capacity(shape[0], ranks) * row_elems_of(shape);
  }
  return packed;
}

UnitShards::UnitShards(const model::ParamLayout& layout, const model::Units& units, int unit,
                       int ranks)
    : UnitShards(layout, units.params(unit), units.range(unit), ranks) {}

UnitShards::UnitShards(const model::ParamLayout& layout, std::span<const size_t> params,
                       model::FlatRange range, int ranks)
    : ranks_(ranks), pieces_(size_t(ranks)) {
  unit_elems_ = range.size();
  for (size_t index : params) {
    const model::ParamInfo& info = layout.params()[index];
    const int64_t rows = info.shape[0], row_elems = row_elems_of(info.shape);
    for (int r = 0; r < ranks; ++r) {
      const ShardRows own = shard_rows(rows, ranks, r);
      pieces_[size_t(r)].push_back(
          {.param = index,
           .rows = own,
           .row_elems = row_elems,
           .unit_offset = info.offset - range.begin + own.begin * row_elems,
           .packed_offset = packed_elems_});
    }
    packed_elems_ += shard_capacity(rows, ranks) * row_elems;
  }
  WL_CHECK(params.empty() ||
           layout.params()[params.back()].offset + layout.params()[params.back()].numel() ==
               range.end)
      << "the parameters do not fill the range";
}

void UnitShards::pack(const float* src, int rank, float* dst) const {
  std::memset(dst, 0, size_t(packed_elems_) * sizeof(float));
  copy_pieces(pieces_[size_t(rank)], src, dst, true);
}

void UnitShards::pack_all(const float* src, float* dst) const {
  for (int r = 0; r < ranks_; ++r) pack(src, r, dst + r * packed_elems_);
}

void UnitShards::unpack_all(const float* src, float* dst) const {
  for (int r = 0; r < ranks_; ++r) unpack(src + r * packed_elems_, r, dst);
}

void UnitShards::unpack(const float* src, int rank, float* dst) const {
  copy_pieces(pieces_[size_t(rank)], src, dst, false);
}

}  // namespace wl::parallel
