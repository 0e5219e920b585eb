// TrainerWeights: one ShardedTensor per model parameter.
#include "weightlift/transfer/layout/trainer_weights.h"

#include "weightlift/model/params.h"

namespace wl::transfer {
namespace {

constexpr size_t kShardAlign = 64;

size_t shard_bytes(const model::ParamInfo& p, int mesh_size, int mesh_rank, DType dtype) {
  const int64_t rows = shard_rows(p.shape[0], mesh_size, mesh_rank).size();
  return size_t(rows * (p.numel() / p.shape[0])) * dtype_size(dtype);
}

size_t aligned(size_t n) { return (n + kShardAlign - 1) / kShardAlign * kShardAlign; }

}  // namespace

size_t TrainerWeights::storage_bytes(const model::ModelConfig& config, int mesh_size, int mesh_rank,
                                     DType dtype) {
  const model::ParamLayout layout(config);
  size_t total = 0;
  for (const model::ParamInfo& p : layout.params()) {
    total += aligned(shard_bytes(p, mesh_size, mesh_rank, dtype));
  }
  return total;
}

TrainerWeights TrainerWeights::from_full(const model::ModelConfig& config,
                                         std::span<const float> full,
                                         std::shared_ptr<comm::Group> mesh,
                                         const TrainerWeightsOptions& options) {
  const model::ParamLayout layout(config);
  WL_CHECK_EQ(int64_t(full.size()), layout.total());
  WL_CHECK(options.storage == nullptr || !options.offload) << "offloading borrowed storage";
  const int mesh_size = mesh ? mesh->size() : 1, mesh_rank = mesh ? mesh->rank() : 0;
  std::byte* next = options.storage;
  TrainerWeights w;
  w.config_ = config;
  w.options_ = options;
  w.mesh_ = mesh;
  for (const model::ParamInfo& p : layout.params()) {
    w.index_.emplace(p.name, w.tensors_.size());
    w.tensors_.push_back(ShardedTensor::from_full({p.name, p.shape, options.dtype, next},
                                                  full.data() + p.offset, mesh));
    if (next != nullptr) next += aligned(shard_bytes(p, mesh_size, mesh_rank, options.dtype));
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
