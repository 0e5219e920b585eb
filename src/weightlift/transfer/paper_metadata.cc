// Paper ranks: the metadata builders of paper_metadata.h.
#include "weightlift/transfer/paper_metadata.h"

#include <string>

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
                        const LayoutOptions& o, int instance) {
  RankMeta m{.rank = rank, .role = Role::kReceiver};
  m.instance = instance;
  m.tp = o.tp;
  m.tp_rank = o.tp_rank;
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
                                int instance) {
  auto lay = inference_layout(c, o);
  if (!lay.ok()) return lay.status().with_context("receiver rank " + std::to_string(rank));
  return paper_receiver(rank, tensor_specs(*lay), o, instance);
}

}  // namespace wl::transfer
