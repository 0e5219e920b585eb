#include "weightlift/core/tensor.h"

#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <unordered_map>

#include "weightlift/core/mutex.h"

namespace wl {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string shape_to_string(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

namespace {

std::atomic<int64_t> g_live_bytes{0}, g_peak_bytes{0};

// Freed tensor storage kept for reuse, by size class. A training step allocates the same
// sizes every time; handing pages back to the kernel and faulting fresh zeroed pages in on
// the next step cost 15% of a `small` step. Sizes are rounded up to eight classes per power
// of two (at most 12.5% more), so that tensors whose size changes a little from step to step
// reuse storage too: the rows an expert-parallel rank receives for its experts follow the
// router. Blocks under kMinPooled come from malloc's own bins anyway. At most kMaxPooled bytes
// stay cached; beyond that, storage is freed.
class StoragePool {
 public:
  static constexpr size_t kMinPooled = 64 << 10;
  static constexpr size_t kMaxPooled = size_t(2) << 30;

  // What get(bytes) allocates.
  static size_t size_class(size_t bytes) {
    if (bytes < kMinPooled) return bytes;
    const size_t step = std::bit_floor(bytes) / 8;
    return (bytes + step - 1) / step * step;
  }

  // REQUIRES: bytes == size_class(bytes), as put() gets it back.
  void* get(size_t bytes) {
    if (bytes >= kMinPooled) {
      MutexLock lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        return p;
      }
    }
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }

  void put(void* p, size_t bytes) {
    if (bytes >= kMinPooled) {
      MutexLock lock(mu_);
      if (cached_ + bytes <= kMaxPooled) {
        free_[bytes].push_back(p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

 private:
  Mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_ WL_GUARDED_BY(mu_);
  size_t cached_ WL_GUARDED_BY(mu_) = 0;
};

// Never destroyed: tensors may be freed during static destruction.
StoragePool& storage_pool() {
  static StoragePool* p = new StoragePool;
  return *p;
}

void count_alloc(int64_t bytes) {
  const int64_t live = g_live_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = g_peak_bytes.load(std::memory_order_relaxed);
  while (live > peak &&
         !g_peak_bytes.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}

Shape row_major_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}
}  // namespace

TensorMemoryStats tensor_memory_stats() {
  return {g_live_bytes.load(std::memory_order_relaxed),
          g_peak_bytes.load(std::memory_order_relaxed)};
}

void reset_tensor_memory_peak() {
  g_peak_bytes.store(g_live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

Tensor Tensor::empty(DType dtype, Shape shape) {
  for (int64_t s : shape) WL_CHECK_GE(s, 0) << "negative dimension in " << shape_to_string(shape);
  Tensor t;
  t.dtype_ = dtype;
  t.strides_ = row_major_strides(shape);
  t.shape_ = std::move(shape);
  size_t bytes = (t.nbytes() + 63) / 64 * 64;
  if (bytes == 0) bytes = 64;
  // The statistics count what the tensor asked for; the pool may hand it a little more.
  const size_t held = StoragePool::size_class(bytes);
  void* p = storage_pool().get(held);
  count_alloc(int64_t(bytes));
  t.storage_ = std::shared_ptr<void>(p, [bytes, held](void* q) {
    g_live_bytes.fetch_sub(int64_t(bytes), std::memory_order_relaxed);
    storage_pool().put(q, held);
  });
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(DType dtype, Shape shape) {
  Tensor t = empty(dtype, std::move(shape));
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::borrow(void* data, DType dtype, Shape shape, std::shared_ptr<const void> keep) {
  Tensor t;
  t.dtype_ = dtype;
  t.strides_ = row_major_strides(shape);
  t.shape_ = std::move(shape);
  t.data_ = data;
  t.storage_ = std::move(keep);
  return t;
}

bool Tensor::is_contiguous() const { return strides_ == row_major_strides(shape_); }

Tensor Tensor::slice(int64_t d, int64_t begin, int64_t end) const {
  WL_CHECK(d >= 0 && d < dim()) << "slice dim " << d << " of " << shape_to_string(shape_);
  WL_CHECK(0 <= begin && begin <= end && end <= shape_[size_t(d)])
      << "slice [" << begin << ", " << end << ") of dim " << d << " of " << shape_to_string(shape_);
  Tensor t = *this;
  t.shape_[size_t(d)] = end - begin;
  t.data_ =
      static_cast<std::byte*>(data_) + begin * strides_[size_t(d)] * int64_t(dtype_size(dtype_));
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  WL_CHECK(is_contiguous()) << "reshape of a strided view";
  WL_CHECK_EQ(shape_numel(shape), numel())
      << shape_to_string(shape_) << " -> " << shape_to_string(shape);
  Tensor t = *this;
  t.strides_ = row_major_strides(shape);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::operator[](int64_t i) const {
  WL_CHECK_GE(dim(), 1);
  Tensor t = slice(0, i, i + 1);
  t.shape_.erase(t.shape_.begin());
  t.strides_.erase(t.strides_.begin());
  return t;
}

namespace {
// Calls fn(dst_offset_bytes, src_offset_bytes, run_bytes) for each contiguous innermost run.
template <typename Fn>
void for_each_run(const Shape& shape, const Shape& st_a, const Shape& st_b, size_t elem, Fn fn) {
  if (shape.empty()) {
    fn(0, 0, elem);
    return;
  }
  const size_t nd = shape.size();
  const int64_t inner = shape[nd - 1];
  const bool a_unit = st_a[nd - 1] == 1, b_unit = st_b[nd - 1] == 1;
  Shape idx(nd, 0);
  const int64_t outer = shape_numel(shape) / (inner ? inner : 1);
  if (shape_numel(shape) == 0) return;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t oa = 0, ob = 0;
    for (size_t k = 0; k + 1 < nd; ++k) {
      oa += idx[k] * st_a[k];
      ob += idx[k] * st_b[k];
    }
    if (a_unit && b_unit) {
      fn(size_t(oa) * elem, size_t(ob) * elem, size_t(inner) * elem);
    } else {
      for (int64_t i = 0; i < inner; ++i)
        fn(size_t(oa + i * st_a[nd - 1]) * elem, size_t(ob + i * st_b[nd - 1]) * elem, elem);
    }
    for (size_t k = nd - 1; k-- > 0;) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  WL_CHECK(dtype_ == src.dtype_) << dtype_name(dtype_) << " vs " << dtype_name(src.dtype_);
  WL_CHECK(shape_ == src.shape_) << shape_to_string(shape_) << " vs "
                                 << shape_to_string(src.shape_);
  if (is_contiguous() && src.is_contiguous()) {
    std::memmove(data_, src.data_, nbytes());
    return;
  }
  auto* d = static_cast<std::byte*>(data_);
  auto* s = static_cast<const std::byte*>(src.data_);
  for_each_run(shape_, strides_, src.strides_, dtype_size(dtype_),
               [&](size_t od, size_t os, size_t n) { std::memcpy(d + od, s + os, n); });
}

Tensor Tensor::clone() const {
  Tensor t = empty(dtype_, shape_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType t) const {
  if (t == dtype_) return clone();
  Tensor src = is_contiguous() ? *this : clone();
  Tensor out = empty(t, shape_);
  if (dtype_ == DType::kF32) {
    convert_from_f32(src.data<float>(), t, out.raw(), size_t(numel()));
  } else if (t == DType::kF32) {
    convert_to_f32(dtype_, src.raw(), out.data<float>(), size_t(numel()));
  } else {
    Tensor f = src.to(DType::kF32);
    convert_from_f32(f.data<float>(), t, out.raw(), size_t(numel()));
  }
  return out;
}

void Tensor::fill_zero() {
  WL_CHECK(is_contiguous());
  std::memset(data_, 0, nbytes());
}

}  // namespace wl
