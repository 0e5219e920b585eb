// ShardedTensor: one parameter held as dim-0 shards over a mesh of trainer ranks, as FSDP
// does, with full_tensor() to rebuild the whole of it on every rank of the mesh.
//
// Sharding is core/shard.h's (torch.chunk on dim 0, as FSDP2 and our own FSDP do) unless the
// options give another RowSplit (a pipeline stage holding its layers whole). Each rank holds
// its rows in bf16 or f32, either in its working buffer or, after offload(), only in a separate
// host buffer (what FSDP's CPU offload does on a GPU machine; here both are host memory, but
// the copy between them is the same stage seed 000 pipelines).
//
// full_tensor() is an allgatherv over the mesh (comm/collectives/allgather.h): every rank moves
// (mesh_size - 1) / mesh_size of the tensor and ends with all of it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/shard.h"
#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"

namespace wl::transfer {

struct ShardedTensorOptions {
  std::string name;           // the parameter's name (model/params.h)
  Shape shape;                // the full tensor's shape, at least 1-D
  DType dtype = DType::kF32;  // kF32 or kBF16
  // Where to keep this rank's rows: borrowed, at least local rows * row elements * dtype size
  // bytes, outliving the tensor. Null: the tensor allocates its own. (The parameter server
  // keeps a checkpoint in one region that restarted receivers read: fleet/heal_from_servers.h.)
  std::byte* storage = nullptr;
  // Which rows each mesh rank holds, over the mesh's size and the tensor's rows; unset:
  // core/shard.h's even rule.
  std::optional<RowSplit> split;
};

class ShardedTensor {
 public:
  ShardedTensor() = default;
  // Keeps this rank's rows of `full` ([shape] f32, borrowed for the call), rounded to dtype.
  // `mesh` null: a mesh of one rank.
  static ShardedTensor from_full(const ShardedTensorOptions& options, const float* full,
                                 std::shared_ptr<comm::Group> mesh);
  // This rank's rows, not yet written (fill them with assign_full).
  static ShardedTensor empty(const ShardedTensorOptions& options,
                             std::shared_ptr<comm::Group> mesh);

  const std::string& name() const { return options_.name; }
  const Shape& shape() const { return options_.shape; }
  DType dtype() const { return options_.dtype; }
  int64_t rows() const { return options_.shape[0]; }
  int64_t row_elems() const;  // elements per row: product of dims after the first
  // The same mesh reconnected (after its old connections failed): same size, same rank.
  void rebind_mesh(std::shared_ptr<comm::Group> mesh);
  int mesh_size() const { return mesh_ ? mesh_->size() : 1; }
  int mesh_rank() const { return mesh_ ? mesh_->rank() : 0; }
  const RowSplit& split() const { return split_; }
  ShardRows local_rows() const { return split_.rank_rows(mesh_rank()); }

  // Where this rank's rows are now: [local_rows().size(), ...] dtype, the working buffer, or
  // the offload buffer when offloaded. Writable (shares storage).
  const Tensor& shard() const { return offloaded_ ? offload_ : working_; }
  bool offloaded() const { return offloaded_; }
  void offload();  // copies the working buffer to the host buffer and frees the working one

  // Replaces this rank's rows with those of `full` ([shape] f32, borrowed), rounded to dtype.
  void assign_full(const float* full);
  // The same from a full tensor of `src` dtype (kF32 or kBF16): a copy when it is the
  // shard's dtype, a conversion otherwise.
  void assign_full(DType src, const void* full);
  // The same from this rank's rows alone (local_rows().size() x row elements of `src` dtype,
  // borrowed): what a rank that shards its model (FSDP) holds.
  void assign_local(DType src, const void* rows);

  // Collective over the mesh. `dst`: numel * dtype_size bytes, the whole tensor row-major.
  Status full_tensor_into(void* dst, std::chrono::milliseconds timeout = {}) const;
  Result<Tensor> full_tensor(std::chrono::milliseconds timeout = {}) const;

 private:
  ShardedTensorOptions options_;
  std::shared_ptr<comm::Group> mesh_;
  RowSplit split_;
  Tensor working_;
  Tensor offload_;
  bool offloaded_ = false;
};

}  // namespace wl::transfer
