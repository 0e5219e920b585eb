// state_bytes.h: DataParallel's allocations (data_parallel.cc), counted.
#include "weightlift/parallel/run/state_bytes.h"

#include <algorithm>

#include "weightlift/core/memory_budget.h"
#include "weightlift/model/tensor_slices.h"
#include "weightlift/parallel/data/unit_shards.h"
#include "weightlift/parallel/pipeline/pipeline.h"

namespace wl::parallel {

namespace {

StageUnits units_of(const model::ModelConfig& config, const model::Units& units,
                    const ParallelLayout& layout, const std::vector<model::Stage>& stages,
                    int stage) {
  StageUnits s;
  if (layout.pp == 1) {
    for (int u = 0; u < units.count(); ++u) s.units.push_back(u);
    return s;
  }
  const model::Stage at = stages[size_t(stage)];
  for (int u = at.first; u <= at.last; ++u) s.units.push_back(u);
  s.tied_replica = config.tie_embeddings && stage == layout.pp - 1;
  return s;
}

}  // namespace

StageUnits stage_units(const model::ModelConfig& config, const model::Units& units,
                       const ParallelLayout& layout, int stage) {
  return units_of(config, units, layout, pipeline_stages(units, layout.pp), stage);
}

Result<std::vector<RankStateBytes>> state_bytes_per_rank(const model::ModelConfig& config,
                                                         const ParallelLayout& layout) {
  // Counting lays out every tensor's ParamInfo: at least this many.
  const uint64_t tensors =
      mul_sat(uint64_t(config.num_layers), add_sat(mul_sat(3, uint64_t(config.num_experts)), 7));
  WL_RETURN_IF_ERROR(check_memory(mul_sat(tensors, sizeof(model::ParamInfo)),
                                  "laying out the parameter tensors of each stage",
                                  std::to_string(tensors) + " tensors or more"));
  WL_RETURN_IF_ERROR(check_expert_parallel(layout, config));
  WL_RETURN_IF_ERROR(check_tensor_parallel(layout, config));
  // A tensor-parallel rank holds a model of its slices' shape (model/tensor_slices.h), and
  // every TP rank as much as the others.
  const model::ModelConfig held_config = model::tp_config(config, layout.tp);
  const model::ParamLayout params(held_config);
  const model::Units units(held_config, params);
  // Every rank of an expert group holds as much as the others: rank 0's parts.
  const UnitParts parts(held_config, params, units, layout.ep, 0);
  const std::vector<model::Stage> stages = pipeline_stages(units, layout.pp);
  std::vector<RankStateBytes> out;
  for (int stage = 0; stage < layout.pp; ++stage) {
    RankStateBytes r{.stage = stage, .held = units_of(held_config, units, layout, stages, stage)};
    std::vector<int> held = r.held.units;
    if (r.held.tied_replica) held.insert(held.begin(), 0);
    uint64_t whole = 0, packed = 0, largest = 0;
    for (int u : held) {
      for (const UnitPart& part : parts.of(u)) {
        const int ranks = part.over == Over::kExpertData ? layout.dp / layout.ep : layout.dp;
        packed += uint64_t(UnitShards::packed_elems_of(params, part.params, ranks));
      }
      whole += uint64_t(parts.held_elems(u));
      largest = std::max(largest, uint64_t(parts.held_elems(u)));
    }
    // Saturating: 16 bytes a parameter overflows int64 for a config whose count does not.
    const auto bytes = [&](bool sharded) {
      return mul_sat(sizeof(float), sharded ? packed : whole);
    };
    r.weights = bytes(layout.shards_parameters());
    r.gradients = bytes(layout.shards_gradients());
    r.adamw = mul_sat(2, bytes(layout.shards_optimizer()));
    r.largest_unit = mul_sat(sizeof(float), largest);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace wl::parallel
