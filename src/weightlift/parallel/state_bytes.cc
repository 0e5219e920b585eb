// state_bytes.h: DataParallel's allocations (data_parallel.cc), counted.
#include "weightlift/parallel/state_bytes.h"

#include <algorithm>

#include "weightlift/core/memory_budget.h"
#include "weightlift/parallel/pipeline.h"
#include "weightlift/parallel/unit_shards.h"

namespace wl::parallel {

StageUnits stage_units(const model::ModelConfig& config, const model::Units& units,
                       const ParallelLayout& layout, int stage) {
  StageUnits s;
  if (layout.pp == 1) {
    for (int u = 0; u < units.count(); ++u) s.units.push_back(u);
    return s;
  }
  const model::Stage at = pipeline_stages(units, layout.pp)[size_t(stage)];
  for (int u = at.first; u <= at.last; ++u) s.units.push_back(u);
  s.tied_replica = config.tie_embeddings && stage == layout.pp - 1;
  return s;
}

Result<std::vector<RankStateBytes>> state_bytes_per_rank(const model::ModelConfig& config,
                                                         const ParallelLayout& layout) {
  // At least what counting holds: every tensor's ParamInfo, and one block's tensors' pieces
  // for each data-parallel rank (the shard table of one unit at a time).
  const uint64_t per_block = add_sat(mul_sat(3, uint64_t(config.num_experts)), 7);
  const uint64_t tensors = mul_sat(uint64_t(config.num_layers), per_block);
  const uint64_t pieces = mul_sat(uint64_t(layout.dp), per_block);
  WL_RETURN_IF_ERROR(check_memory(
      add_sat(mul_sat(tensors, sizeof(model::ParamInfo)), mul_sat(pieces, sizeof(ShardPiece))),
      "laying out the parameter tensors of each stage",
      std::to_string(tensors) + " tensors, " + std::to_string(pieces) + " shard pieces per unit"));
  const model::ParamLayout params(config);
  const model::Units units(config, params);
  std::vector<RankStateBytes> out;
  for (int stage = 0; stage < layout.pp; ++stage) {
    RankStateBytes r{.stage = stage, .held = stage_units(config, units, layout, stage)};
    std::vector<int> held = r.held.units;
    if (r.held.tied_replica) held.insert(held.begin(), 0);
    int64_t whole = 0, packed = 0, largest = 0;
    for (int u : held) {
      whole += units.range(u).size();
      packed += UnitShards(params, units, u, layout.dp).packed_elems();
      largest = std::max(largest, units.range(u).size());
    }
    const auto bytes = [&](bool sharded) { return int64_t(sizeof(float)) * (sharded ? packed : whole); };
    r.weights = bytes(layout.shards_parameters());
    r.gradients = bytes(layout.shards_gradients());
    r.adamw = 2 * bytes(layout.shards_optimizer());
    r.largest_unit = int64_t(sizeof(float)) * largest;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace wl::parallel
