// TrainerWeights: every parameter of one trainer rank, as ShardedTensors over its FSDP mesh.
//
// A job may run several meshes (data-parallel replicas, each sharding the whole model over
// its ranks); every mesh has the same size, so the same rows sit at the same mesh rank of
// every mesh, and the planner may take a row from whichever replica has sent the least.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/transfer/layout/layout_spec.h"
#include "weightlift/transfer/layout/sharded_tensor.h"

namespace wl::model {
class ParamLayout;
}  // namespace wl::model

namespace wl::transfer {

struct TrainerWeightsOptions {
  DType dtype = DType::kF32;  // the shards' dtype: kF32 or kBF16
  bool offload = false;       // keep the shards only in the host offload buffers
  int mesh_id = 0;            // which mesh (replica) this rank belongs to
  // Borrowed, storage_bytes() of it: every shard in one block, ParamLayout order, each at a
  // 64-byte boundary. Null: each shard allocates its own. Not with offload.
  std::byte* storage = nullptr;
  // Which mesh rank holds which rows of each parameter of our model, in ParamLayout order,
  // each over the mesh's size; empty: core/shard.h's even rule for every parameter (the only
  // rule for another model's weights, from_spec).
  std::vector<RowSplit> splits;
};

// One whole parameter as a caller holds it (a PyTorch state dict's tensor): borrowed, row-major.
struct NamedTensor {
  std::string name;
  DType dtype = DType::kF32;  // kF32 or kBF16
  Shape shape;
  const void* data = nullptr;
};

// One parameter's rows as a rank that shards its model holds them (FSDP's own rows, by
// core/shard.h's rule over the mesh, or a pipeline stage's whole layers by another RowSplit):
// a rank fills its shards from these with no whole copy of the model anywhere.
struct OwnRows {
  size_t param = 0;             // index into model::ParamLayout::params()
  ShardRows rows;               // of the parameter's dim 0
  const float* data = nullptr;  // rows.size() x the row's elements, f32, borrowed
};

// OK when `rows` give, once each, this mesh rank's rows of every parameter of `config` that
// has any on it (by `splits`, one per parameter, or the even rule when empty); otherwise
// InvalidArgument naming the parameter (and the rows given and expected where they differ).
Status check_own_rows(const model::ModelConfig& config, int mesh_size, int mesh_rank,
                      std::span<const OwnRows> rows, std::span<const RowSplit> splits = {});

// OK when `tensors` are every parameter of `config` exactly once, each with its shape and
// dtype kF32 or kBF16; otherwise InvalidArgument naming the tensor.
Status check_named_tensors(const model::ModelConfig& config, std::span<const NamedTensor> tensors);
// The same for any model: every tensor of `spec.params`, with the shape it has there.
Status check_named_tensors(const LayoutSpec& spec, std::span<const NamedTensor> tensors);

class TrainerWeights {
 public:
  // `full`: every parameter in f32, model::ParamLayout order, borrowed for the call.
  // `mesh`: this rank's mesh (null: a mesh of one).
  static TrainerWeights from_full(const model::ModelConfig& config, std::span<const float> full,
                                  std::shared_ptr<comm::Group> mesh,
                                  const TrainerWeightsOptions& options);

  // From whole parameters in f32 or bf16 (REQUIRES: check_named_tensors passed): each shard
  // copied from its tensor, converted only where the dtypes differ.
  static TrainerWeights from_named(const model::ModelConfig& config,
                                   std::span<const NamedTensor> tensors,
                                   std::shared_ptr<comm::Group> mesh,
                                   const TrainerWeightsOptions& options);

  // From this rank's own rows of every parameter (REQUIRES: check_own_rows passed for the
  // mesh's size and rank).
  static TrainerWeights from_own_rows(const model::ModelConfig& config,
                                      std::span<const OwnRows> rows,
                                      std::shared_ptr<comm::Group> mesh,
                                      const TrainerWeightsOptions& options);

  // Any model's weights, named and shaped as `spec.params` says (REQUIRES:
  // check_named_tensors(spec, tensors) passed), in that order. The planner builds the
  // receivers' tensors from `spec` instead of our model's layout.
  static TrainerWeights from_spec(const LayoutSpec& spec, std::span<const NamedTensor> tensors,
                                  std::shared_ptr<comm::Group> mesh,
                                  const TrainerWeightsOptions& options);

  // Bytes TrainerWeightsOptions::storage must have for this rank's shards (cut by `splits`,
  // as in the options).
  static size_t storage_bytes(const model::ModelConfig& config, int mesh_size, int mesh_rank,
                              DType dtype, std::span<const RowSplit> splits = {});
  static size_t storage_bytes(const LayoutSpec& spec, int mesh_size, int mesh_rank, DType dtype);

  // The same mesh reconnected (after its old connections failed): same size, same rank.
  void rebind_mesh(std::shared_ptr<comm::Group> mesh);

  // New values for every shard (a training step happened), from the full f32 weights, the
  // tensors spread over the compute threads. REQUIRES: our model's weights (config() is not
  // null).
  void assign_full(std::span<const float> full);
  // check_own_rows for these weights' mesh, against their shards (no model layout built).
  Status check_own_rows(std::span<const OwnRows> rows) const;
  // The same from this rank's own rows (REQUIRES: check_own_rows passed).
  void assign_own_rows(std::span<const OwnRows> rows);
  // The same from whole parameters (REQUIRES: check_named_tensors passed).
  void assign_named(std::span<const NamedTensor> tensors);
  // The floats assign_full() takes: our model's parameter count (0 for another model's).
  int64_t full_floats() const { return total_; }

  // Our model's config; null for another model's weights (from_spec).
  const model::ModelConfig* config() const { return config_ ? &*config_ : nullptr; }
  // The layout of another model's weights (from_spec); null for ours.
  const LayoutSpec* layout_spec() const { return spec_ ? &*spec_ : nullptr; }
  const TrainerWeightsOptions& options() const { return options_; }
  int mesh_id() const { return options_.mesh_id; }
  int mesh_rank() const { return mesh_ ? mesh_->rank() : 0; }
  int mesh_size() const { return mesh_ ? mesh_->size() : 1; }
  comm::Group* mesh() const { return mesh_.get(); }  // null: a mesh of one

  const std::vector<ShardedTensor>& tensors() const { return tensors_; }
  std::vector<ShardedTensor>& tensors() { return tensors_; }
  const ShardedTensor* find(std::string_view name) const;

 private:
  // A parameter as build() lays out its shard.
  struct Param {
    std::string name;
    Shape shape;
  };

  std::optional<model::ModelConfig> config_;
  std::optional<LayoutSpec> spec_;
  TrainerWeightsOptions options_;
  std::shared_ptr<comm::Group> mesh_;
  std::vector<ShardedTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<int64_t> offsets_;       // our model's: each tensor's in ParamLayout's f32 block
  int64_t total_ = 0;                  // that block's floats
  std::vector<size_t> largest_first_;  // tensors_ by their shard's size, for assign_full()

  void set_offsets(const model::ParamLayout& layout);
  // Shards for `params` in order, the i-th filled by fill(tensor, i).
  template <typename Fill>
  static TrainerWeights build(std::span<const Param> params, std::shared_ptr<comm::Group> mesh,
                              const TrainerWeightsOptions& options, Fill fill);
};

}  // namespace wl::transfer
