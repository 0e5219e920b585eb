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

Status check_named_tensors(const model::ModelConfig& config, std::span<const NamedTensor> tensors) {
  const model::ParamLayout layout(config);
  std::unordered_map<std::string, const NamedTensor*> by_name;
  for (const NamedTensor& t : tensors) {
    if (!layout.find(t.name)) {
      return invalid_argument("tensor '" + t.name + "' is not a parameter of the model");
    }
    if (!by_name.emplace(t.name, &t).second) {
      return invalid_argument("tensor '" + t.name + "' is given twice");
    }
  }
  for (const model::ParamInfo& p : layout.params()) {
    auto it = by_name.find(p.name);
    if (it == by_name.end()) return invalid_argument("tensor '" + p.name + "' is missing");
    const NamedTensor& t = *it->second;
    if (t.shape != p.shape) {
      return invalid_argument("tensor '" + p.name + "' has shape " + shape_to_string(t.shape) +
                              "; the model's is " + shape_to_string(p.shape));
    }
    if (t.dtype != DType::kF32 && t.dtype != DType::kBF16) {
      return invalid_argument("tensor '" + p.name + "' is " + std::string(dtype_name(t.dtype)) +
                              "; parameters are F32 or BF16");
    }
    if (t.data == nullptr) return invalid_argument("tensor '" + p.name + "' has no data");
  }
  return ok_status();
}

template <typename Fill>
TrainerWeights TrainerWeights::build(const model::ModelConfig& config,
                                     std::shared_ptr<comm::Group> mesh,
                                     const TrainerWeightsOptions& options, Fill fill) {
  const model::ParamLayout layout(config);
  WL_CHECK(options.storage == nullptr || !options.offload) << "offloading borrowed storage";
  const int mesh_size = mesh ? mesh->size() : 1, mesh_rank = mesh ? mesh->rank() : 0;
  std::byte* next = options.storage;
  TrainerWeights w;
  w.config_ = config;
  w.options_ = options;
  w.mesh_ = mesh;
  for (const model::ParamInfo& p : layout.params()) {
    w.index_.emplace(p.name, w.tensors_.size());
    w.tensors_.push_back(ShardedTensor::empty({p.name, p.shape, options.dtype, next}, mesh));
    fill(w.tensors_.back(), p);
    if (next != nullptr) next += aligned(shard_bytes(p, mesh_size, mesh_rank, options.dtype));
    if (options.offload) w.tensors_.back().offload();
  }
  return w;
}

TrainerWeights TrainerWeights::from_full(const model::ModelConfig& config,
                                         std::span<const float> full,
                                         std::shared_ptr<comm::Group> mesh,
                                         const TrainerWeightsOptions& options) {
  WL_CHECK_EQ(int64_t(full.size()), model::ParamLayout(config).total());
  return build(config, std::move(mesh), options, [&](ShardedTensor& t, const model::ParamInfo& p) {
    t.assign_full(full.data() + p.offset);
  });
}

TrainerWeights TrainerWeights::from_named(const model::ModelConfig& config,
                                          std::span<const NamedTensor> tensors,
                                          std::shared_ptr<comm::Group> mesh,
                                          const TrainerWeightsOptions& options) {
  // The caller checked the set (check_named_tensors): every parameter is there once, with
  // its shape and a dtype the shards take.
  std::unordered_map<std::string, const NamedTensor*> by_name;
  for (const NamedTensor& t : tensors) by_name.emplace(t.name, &t);
  return build(config, std::move(mesh), options, [&](ShardedTensor& t, const model::ParamInfo& p) {
    auto it = by_name.find(p.name);
    WL_CHECK(it != by_name.end()) << "from_named: no tensor '" << p.name << "'";
    t.assign_full(it->second->dtype, it->second->data);
  });
}

void TrainerWeights::assign_named(std::span<const NamedTensor> tensors) {
  for (const NamedTensor& n : tensors) {
    tensors_[index_.at(n.name)].assign_full(n.dtype, n.data);
  }
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
