// Tensor: a dtype, a shape and strides over bytes that it owns or borrows.
//
// Owning tensors allocate 64-byte-aligned storage and share it between copies and views
// (copying a Tensor never copies data; clone() does). Borrowed tensors view memory someone
// else keeps alive: a mmapped safetensors file, a registered UCX buffer. Strides are in
// elements; everything we allocate is row-major contiguous, and strided views come only from
// slice() (a column slice for row-parallel TP shards, say).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/core/dtype.h"

namespace wl {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& shape);

// Bytes held by owning tensors now and at most since the last reset: how activation memory
// (gradient checkpointing's whole point) is measured.
struct TensorMemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
TensorMemoryStats tensor_memory_stats();
void reset_tensor_memory_peak();                  // peak := live
std::string shape_to_string(const Shape& shape);  // "[4, 64]"

class Tensor {
 public:
  Tensor() = default;  // empty: shape [0], no storage

  static Tensor empty(DType dtype, Shape shape);  // uninitialised
  static Tensor zeros(DType dtype, Shape shape);
  // Views `data` without owning it; `keep_alive` (may be null) is held as long as the view.
  static Tensor borrow(void* data, DType dtype, Shape shape,
                       std::shared_ptr<const void> keep_alive = nullptr);

  // False only for a default-constructed Tensor (owning tensors always hold storage, even
  // with zero elements; borrowed ones hold a pointer).
  bool defined() const { return data_ != nullptr || storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const { return shape_.at(size_t(d < 0 ? d + dim() : d)); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    WL_CHECK_EQ(sizeof(T), dtype_size(dtype_)) << "data<T>() on a " << dtype_name(dtype_);
    return static_cast<T*>(data_);
  }
  std::span<std::byte> bytes() const {
    WL_CHECK(is_contiguous()) << "bytes() of a strided view";
    return {static_cast<std::byte*>(data_), nbytes()};
  }

  // Views sharing storage.
  Tensor slice(int64_t dim, int64_t begin, int64_t end) const;  // [begin, end) along dim
  Tensor reshape(Shape shape) const;                            // contiguous only
  Tensor operator[](int64_t i) const;                           // drops dim 0

  Tensor clone() const;               // contiguous copy
  Tensor to(DType t) const;           // converting copy between float types
  void copy_from(const Tensor& src);  // same dtype and shape; strided either side
  void fill_zero();

 private:
  DType dtype_ = DType::kF32;
  Shape shape_{0};
  Shape strides_{1};
  void* data_ = nullptr;
  std::shared_ptr<const void> storage_;
};

}  // namespace wl
