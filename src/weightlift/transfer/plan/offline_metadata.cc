// Paper ranks: the metadata builders of plan/offline_metadata.h.
#include "weightlift/transfer/plan/offline_metadata.h"

#include <string>

#include "weightlift/core/memory_budget.h"
#include "weightlift/model/params.h"

namespace wl::transfer {

RankMeta paper_trainer(const model::ModelConfig& c, int rank, int mesh_id, int mesh_rank,
                       int mesh_size, DType dtype) {
  RankMeta m{.rank = rank, .role = Role::kTrainer};
  m.config_json = model::config_to_json(c);
  m.mesh_id = mesh_id;
  m.mesh_rank = mesh_rank;
  m.mesh_size = mesh_size;
  const model::ParamLayout layout(c);
  for (const model::ParamInfo& p : layout.params()) {
    const ShardRows r = shard_rows(p.shape[0], mesh_size, mesh_rank);
    m.params.push_back({p.name, p.shape, dtype, r.begin, r.end, false});
  }
  return m;
}

RankMeta paper_receiver(int rank, const std::vector<ReceiverTensorSpec>& specs,
                        const LayoutOptions& o, int engine) {
  RankMeta m{.rank = rank, .role = Role::kReceiver};
  m.engine = engine;
  m.tp = o.tp;
  m.tp_rank = o.tp_rank;
  m.ep = o.ep;
  m.ep_rank = o.ep_rank;
  m.format = o.format;
  m.epoch = 1000 + uint64_t(rank);
  m.worker_address = {std::byte{1}, std::byte{2}};
  m.rkey = {std::byte{3}};
  size_t slot_bytes = 0;
  for (const ReceiverEntry& e : pack_receiver_tensors(specs, &slot_bytes)) {
    m.tensors.push_back({e.spec.name, e.spec.dtype, e.spec.shape, e.offset, e.bytes});
  }
  m.slot_bytes = slot_bytes;
  m.slot_address[0] = 1 << 20;
  m.slot_address[1] = (1 << 20) + slot_bytes;
  return m;
}

Result<RankMeta> paper_receiver(const model::ModelConfig& c, int rank, const LayoutOptions& o,
                                int engine) {
  auto lay = inference_layout(c, o);
  if (!lay.ok()) return lay.status().with_context("receiver rank " + std::to_string(rank));
  return paper_receiver(rank, tensor_specs(*lay), o, engine);
}

namespace {

// What the planning holds at least, before it allocates any of it: each trainer's metadata
// (an entry per parameter), each receiver's (an entry per tensor), and at least one task per
// receiver tensor. Per entry, the struct and its name's heap buffer.
Status check_plan_memory(const OfflineJob& o) {
  constexpr uint64_t kEntryBytes = sizeof(ParamMeta) + 48,
                     kTaskBytes = sizeof(PlanTask) + sizeof(PlanPiece) + 96;
  const model::ModelConfig& c = o.config;
  const uint64_t params = mul_sat(uint64_t(c.num_layers), 7 + 3 * uint64_t(c.num_experts)) + 3;
  const auto layout = inference_layout(c, {.tp = o.tp, .ep = o.ep, .format = o.format});
  if (!layout.ok()) return ok_status();  // refused below, naming the receiver rank
  const uint64_t trainers = mul_sat(mul_sat(uint64_t(o.trainers), params), kEntryBytes);
  const uint64_t receivers =
      mul_sat(mul_sat(uint64_t(o.receivers), layout->size()), kEntryBytes + kTaskBytes);
  return check_memory(add_sat(trainers, receivers),
                      "a plan for " + std::to_string(o.trainers) + " trainers and " +
                          std::to_string(o.receivers) + " receivers",
                      format_bytes(trainers) + " of trainer metadata, " + format_bytes(receivers) +
                          " of receiver metadata and tasks");
}

}  // namespace

Result<Plan> plan_offline(const OfflineJob& o) {
  if (o.trainers < 1 || o.receivers < 1 || o.tp < 1 || o.ep < 1 || o.mesh_size < 0) {
    return invalid_argument("offline plan: " + std::to_string(o.trainers) + " trainers, " +
                            std::to_string(o.receivers) + " receivers, tp " + std::to_string(o.tp) +
                            ", ep " + std::to_string(o.ep) + ", mesh size " +
                            std::to_string(o.mesh_size) +
                            ": need at least one trainer and one receiver, tp >= 1, ep >= 1, "
                            "mesh size >= 0");
  }
  const int mesh_size = o.mesh_size == 0 ? o.trainers : o.mesh_size;
  if (o.trainers % mesh_size != 0) {
    return invalid_argument("offline plan: mesh size " + std::to_string(mesh_size) +
                            " does not divide the " + std::to_string(o.trainers) + " trainers");
  }
  const int engine = o.tp * o.ep;
  if (o.receivers % engine != 0) {
    return invalid_argument("offline plan: " +
                            (o.ep > 1 ? "tp " + std::to_string(o.tp) + " x ep " +
                                            std::to_string(o.ep) + " = " + std::to_string(engine)
                                      : "tp " + std::to_string(o.tp)) +
                            " does not divide the " + std::to_string(o.receivers) +
                            " receivers (each engine is " + (o.ep > 1 ? "tp x ep" : "tp") +
                            " of them)");
  }
  WL_RETURN_IF_ERROR(check_plan_memory(o));
  std::vector<RankMeta> ranks;
  for (int i = 0; i < o.trainers; ++i) {
    ranks.push_back(
        paper_trainer(o.config, i, i / mesh_size, i % mesh_size, mesh_size, o.shard_dtype));
  }
  for (int i = 0; i < o.receivers; ++i) {
    const LayoutOptions layout{.tp = o.tp,
                               .tp_rank = i % o.tp,
                               .ep = o.ep,
                               .ep_rank = i % engine / o.tp,
                               .format = o.format};
    WL_ASSIGN_OR_RETURN(RankMeta r, paper_receiver(o.config, o.trainers + i, layout, i / engine));
    ranks.push_back(std::move(r));
  }
  return make_plan(ranks);
}

}  // namespace wl::transfer
