// TrainerWeights: one ShardedTensor per model parameter.
#include "weightlift/transfer/trainer_weights.h"

#include "weightlift/model/params.h"

namespace wl::transfer {

TrainerWeights TrainerWeights::from_full(const model::ModelConfig& config,
                                         std::span<const float> full,
                                         std::shared_ptr<comm::Group> mesh,
                                         const TrainerWeightsOptions& options) {
  const model::ParamLayout layout(config);
  WL_CHECK_EQ(int64_t(full.size()), layout.total());
  TrainerWeights w;
  w.config_ = config;
  w.options_ = options;
  w.mesh_ = mesh;
  for (const model::ParamInfo& p : layout.params()) {
    w.index_.emplace(p.name, w.tensors_.size());
    w.tensors_.push_back(ShardedTensor::from_full({p.name, p.shape, options.dtype},
                                                  full.data() + p.offset, mesh));
    if (options.offload) w.tensors_.back().offload();
  }
  return w;
}

void TrainerWeights::assign_full(std::span<const float> full) {
  const model::ParamLayout layout(config_);
  WL_CHECK_EQ(int64_t(full.size()), layout.total());
  for (ShardedTensor& t : tensors_) t.assign_full(full.data() + layout.at(t.name()).offset);
}

const ShardedTensor* TrainerWeights::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void TrainerWeights::rebind_mesh(std::shared_ptr<comm::Group> mesh) {
  for (ShardedTensor& t : tensors_) t.rebind_mesh(mesh);
  mesh_ = std::move(mesh);
}

}  // namespace wl::transfer
