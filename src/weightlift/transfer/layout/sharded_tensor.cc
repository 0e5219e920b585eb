// ShardedTensor: row ranges of a RowSplit, offload copies and full_tensor() by allgatherv.
#include "weightlift/transfer/layout/sharded_tensor.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/core/parallel.h"

namespace wl::transfer {
namespace {

// Elements a thread converts at least when a tensor is assigned (256 KiB of f32).
constexpr int64_t kAssignGrain = int64_t(1) << 16;

}  // namespace

int64_t ShardedTensor::row_elems() const {
  int64_t n = 1;
  for (size_t i = 1; i < options_.shape.size(); ++i) n *= options_.shape[i];
  return n;
}

ShardedTensor ShardedTensor::from_full(const ShardedTensorOptions& options, const float* full,
                                       std::shared_ptr<comm::Group> mesh) {
  ShardedTensor t = empty(options, std::move(mesh));
  t.assign_full(full);
  return t;
}

ShardedTensor ShardedTensor::empty(const ShardedTensorOptions& options,
                                   std::shared_ptr<comm::Group> mesh) {
  WL_CHECK(!options.shape.empty()) << options.name << ": a sharded tensor is at least 1-D";
  WL_CHECK(options.dtype == DType::kF32 || options.dtype == DType::kBF16)
      << options.name << ": " << dtype_name(options.dtype);
  ShardedTensor t;
  t.options_ = options;
  t.mesh_ = std::move(mesh);
  t.split_ = options.split ? *options.split : RowSplit::even(t.rows(), t.mesh_size());
  WL_CHECK(t.split_.ranks() == t.mesh_size() && t.split_.rows() == t.rows())
      << options.name << ": a split of " << t.split_.rows() << " rows over " << t.split_.ranks()
      << " ranks for " << t.rows() << " rows over a mesh of " << t.mesh_size();
  Shape local = options.shape;
  local[0] = t.local_rows().size();
  t.working_ = options.storage != nullptr ? Tensor::borrow(options.storage, options.dtype, local)
                                          : Tensor::empty(options.dtype, local);
  return t;
}

void ShardedTensor::assign_full(const float* full) { assign_full(DType::kF32, full); }

void ShardedTensor::assign_full(DType src, const void* full) {
  assign_local(src, static_cast<const std::byte*>(full) +
                        size_t(local_rows().begin * row_elems()) * dtype_size(src));
}

void ShardedTensor::assign_local(DType src, const void* rows) {
  WL_CHECK(src == DType::kF32 || src == DType::kBF16) << options_.name << ": " << dtype_name(src);
  const Tensor& dst = shard();
  const size_t n = size_t(local_rows().size() * row_elems());
  const auto* from = static_cast<const std::byte*>(rows);
  const DType to = options_.dtype;
  std::byte* into = static_cast<std::byte*>(dst.raw());
  // Memory-bound: a refresh between training steps converts the whole model, so every
  // compute thread takes a share.
  parallel_for(int64_t(n), kAssignGrain, [&](int64_t begin, int64_t end) {
    const size_t b = size_t(begin), count = size_t(end - begin);
    if (src == to) {
      std::memcpy(into + b * dtype_size(src), from + b * dtype_size(src), count * dtype_size(src));
    } else if (src == DType::kF32) {
      convert_from_f32(reinterpret_cast<const float*>(from) + b, to, into + b * dtype_size(to),
                       count);
    } else {  // bf16 into an f32 shard: exact
      convert_bf16_to_f32(reinterpret_cast<const uint16_t*>(from) + b,
                          reinterpret_cast<float*>(into) + b, count);
    }
  });
}

void ShardedTensor::offload() {
  if (offloaded_) return;
  if (!offload_.defined() || offload_.numel() != working_.numel() || offload_.raw() == nullptr) {
    offload_ = Tensor::empty(working_.dtype(), working_.shape());
  }
  offload_.copy_from(working_);
  working_ = Tensor();
  offloaded_ = true;
}

Status ShardedTensor::full_tensor_into(void* dst, std::chrono::milliseconds timeout) const {
  const ShardRows mine = local_rows();
  if (mesh_size() == 1) {
    if (mine.size() > 0) std::memcpy(dst, shard().raw(), shard().nbytes());
    return ok_status();
  }
  std::vector<size_t> counts;
  for (int r = 0; r < mesh_size(); ++r) {
    counts.push_back(size_t(split_.rank_rows(r).size() * row_elems()));
  }
  Status s = comm::allgatherv(
      *mesh_,
      {.send = shard().raw(), .recv = dst, .counts = counts, .dtype = dtype(), .timeout = timeout});
  if (!s.ok()) return s.with_context("full_tensor of " + name());
  return ok_status();
}

Result<Tensor> ShardedTensor::full_tensor(std::chrono::milliseconds timeout) const {
  Tensor full = Tensor::empty(dtype(), shape());
  WL_RETURN_IF_ERROR(full_tensor_into(full.raw(), timeout));
  return full;
}

void ShardedTensor::rebind_mesh(std::shared_ptr<comm::Group> mesh) {
  WL_CHECK_EQ(mesh ? mesh->size() : 1, mesh_size()) << "rebinding to a mesh of another size";
  WL_CHECK_EQ(mesh ? mesh->rank() : 0, mesh_rank()) << "rebinding to another mesh rank";
  mesh_ = std::move(mesh);
}

}  // namespace wl::transfer
