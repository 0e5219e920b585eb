// describe_plan: paper ranks for every trainer and receiver, make_plan, then text or JSON.
#include "weightlift/transfer/plan_command.h"

#include <vector>

#include "weightlift/model/config.h"
#include "weightlift/transfer/paper_metadata.h"
#include "weightlift/transfer/planner.h"

namespace wl::transfer {

Result<std::string> describe_plan(const PlanCommandOptions& o) {
  const std::string where = "transfer plan: ";
  auto config = model::preset(o.preset);
  if (!config.ok()) return config.status().with_context("transfer plan --preset");
  const std::optional<WeightFormat> format = weight_format_from_name(o.dtype);
  if (!format) {
    return invalid_argument(where + "--dtype '" + o.dtype + "' is neither bf16 nor fp8");
  }
  DType shard_dtype = DType::kF32;
  if (o.shard_dtype == "bf16") {
    shard_dtype = DType::kBF16;
  } else if (o.shard_dtype != "f32") {
    return invalid_argument(where + "--shard-dtype '" + o.shard_dtype +
                            "' is neither f32 nor bf16");
  }
  if (o.trainers < 1 || o.receivers < 1 || o.tp < 1 || o.mesh_size < 0) {
    return invalid_argument(
        where + "--trainers " + std::to_string(o.trainers) + ", --receivers " +
        std::to_string(o.receivers) + ", --tp " + std::to_string(o.tp) + ", --mesh-size " +
        std::to_string(o.mesh_size) +
        ": need at least one trainer and one receiver, tp >= 1, mesh size >= 0");
  }
  const int mesh_size = o.mesh_size == 0 ? o.trainers : o.mesh_size;
  if (o.trainers % mesh_size != 0) {
    return invalid_argument(where + "--mesh-size " + std::to_string(mesh_size) +
                            " does not divide --trainers " + std::to_string(o.trainers));
  }
  if (o.receivers % o.tp != 0) {
    return invalid_argument(where + "--tp " + std::to_string(o.tp) +
                            " does not divide --receivers " + std::to_string(o.receivers) +
                            " (each engine is tp receivers)");
  }
  std::vector<RankMeta> ranks;
  for (int i = 0; i < o.trainers; ++i) {
    ranks.push_back(
        paper_trainer(*config, i, i / mesh_size, i % mesh_size, mesh_size, shard_dtype));
  }
  for (int i = 0; i < o.receivers; ++i) {
    const LayoutOptions layout{.tp = o.tp, .tp_rank = i % o.tp, .format = *format};
    auto r = paper_receiver(*config, o.trainers + i, layout, i / o.tp);
    if (!r.ok()) return r.status().with_context("transfer plan (preset " + o.preset + ")");
    ranks.push_back(*std::move(r));
  }
  WL_ASSIGN_OR_RETURN(Plan plan, make_plan(ranks));
  return o.json ? plan_to_json(plan) : format_plan(plan);
}

}  // namespace wl::transfer
