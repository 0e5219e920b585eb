#include "weightlift/core/tensor.h"

#include <gtest/gtest.h>

#include <cstdint>

#include "weightlift/core/aligned.h"

namespace wl {
namespace {

Tensor iota(Shape shape) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = float(i);
  return t;
}

TEST(Tensor, OwningIsAlignedAndZeroed) {
  Tensor t = Tensor::zeros(DType::kBF16, {3, 5});
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(t.nbytes(), 30u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.data<uint16_t>()[i], 0);
}

TEST(Tensor, SliceRowsSharesStorage) {
  Tensor t = iota({4, 3});
  Tensor rows = t.slice(0, 1, 3);
  EXPECT_TRUE(rows.is_contiguous());
  EXPECT_EQ(rows.data<float>()[0], 3.f);
  rows.data<float>()[0] = -1;
  EXPECT_EQ(t.data<float>()[3], -1.f);
}

TEST(Tensor, SliceColumnsIsStridedAndCopiesCorrectly) {
  Tensor t = iota({4, 6});
  Tensor cols = t.slice(1, 2, 5);  // [4, 3], stride 6
  EXPECT_FALSE(cols.is_contiguous());
  Tensor c = cols.clone();
  ASSERT_TRUE(c.is_contiguous());
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(c.data<float>()[r * 3 + k], float(r * 6 + 2 + k));
  Tensor back = Tensor::zeros(DType::kF32, {4, 6});
  back.slice(1, 2, 5).copy_from(c);
  EXPECT_EQ(back.data<float>()[6 + 3], 9.f);
  EXPECT_EQ(back.data<float>()[6 + 1], 0.f);
}

TEST(Tensor, EmptyShapesWork) {
  Tensor t = Tensor::empty(DType::kF32, {0, 4});
  EXPECT_EQ(t.numel(), 0);
  Tensor c = t.clone();
  EXPECT_EQ(c.shape(), (Shape{0, 4}));
}

TEST(Tensor, ConvertsBetweenFloatTypes) {
  Tensor t = iota({2, 3});
  Tensor b = t.to(DType::kBF16).to(DType::kF32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b.data<float>()[i], float(i));
}

// Freed storage comes back for a tensor a little larger or smaller (the rows an expert rank
// receives change every step), while the memory statistics count what each tensor asked for.
TEST(Tensor, StorageOfANearbySizeIsReused) {
  Tensor a = Tensor::empty(DType::kF32, {100000});  // 400000 bytes: class 425984
  const void* storage = a.raw();
  const int64_t before = tensor_memory_stats().live_bytes;
  a = Tensor();
  EXPECT_EQ(tensor_memory_stats().live_bytes, before - 400000);
  Tensor b = Tensor::empty(DType::kF32, {104000});
  EXPECT_EQ(b.raw(), storage);
  EXPECT_EQ(tensor_memory_stats().live_bytes, before - 400000 + 416000);
  b = Tensor();
  Tensor far = Tensor::empty(DType::kF32, {120000});  // 480000 bytes: another class
  EXPECT_NE(far.raw(), storage);
}

// GEMM scratch starts on a cache line whatever its size: small ones from the heap, large ones
// mapped (where a std::vector's data sits 16 bytes past the line), and after growing.
TEST(AlignedVector, DataStartsOnACacheLine) {
  for (const size_t n : {size_t(1), size_t(5), size_t(1000), size_t(1) << 18, size_t(3) << 20}) {
    AlignedVector<float> v(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kCacheLine, 0u) << n << " floats";
    v.resize(2 * n + 3);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kCacheLine, 0u) << "grown from " << n;
    AlignedVector<uint16_t> h(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(h.data()) % kCacheLine, 0u) << n << " halves";
  }
}

TEST(TensorDeath, ReshapeMismatchIsABug) {
  Tensor t = iota({2, 3});
  EXPECT_DEATH(t.reshape({4, 2}), "check failed");
}

}  // namespace
}  // namespace wl
