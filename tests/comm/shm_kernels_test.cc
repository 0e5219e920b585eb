// The shared-memory collectives' reduction loops (detail/shm_kernels.h): every vector width
// this CPU has against the portable reduce() and divide(), bit for bit, at every alignment that
// changes which stores the loop makes (whole vectors or 16-byte pieces of them, streamed or
// plain), with the head and tail lengths that alignment leaves, in place, and with nothing
// written outside the destinations.
#include "weightlift/comm/collectives/detail/shm_kernels.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace wl::comm::detail {
namespace {

constexpr uint8_t kGuardByte = 0x5a;
constexpr size_t kGuardBytes = 128;

// `count` elements at `offset` bytes past a 64-byte boundary, with guard bytes on both sides.
class Placed {
 public:
  Placed(DType t, size_t count, size_t offset)
      : bytes_(count * dtype_size(t)), mem_(bytes_ + 3 * kGuardBytes, kGuardByte) {
    const auto base = reinterpret_cast<uintptr_t>(mem_.data());
    start_ = kGuardBytes + (64 - base % 64) % 64 + offset;
  }
  std::byte* data() { return reinterpret_cast<std::byte*>(mem_.data() + start_); }
  std::vector<uint8_t> contents() const {
    return {mem_.begin() + long(start_), mem_.begin() + long(start_ + bytes_)};
  }
  bool guards_intact() const {
    for (size_t i = 0; i < mem_.size(); ++i) {
      if ((i < start_ || i >= start_ + bytes_) && mem_[i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  size_t bytes_, start_ = 0;
  std::vector<uint8_t> mem_;
};

// Values whose sums and averages round (f32: mixed magnitudes and signs; bf16 and i32 alike
// random bits in range).
std::vector<uint8_t> random_values(DType t, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(count * dtype_size(t));
  for (size_t i = 0; i < count; ++i) {
    if (t == DType::kF32) {
      const float v = std::uniform_real_distribution<float>(-1, 1)(rng) *
                      float(1 << std::uniform_int_distribution<int>(0, 20)(rng));
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else if (t == DType::kBF16) {
      const auto v = f32_to_bf16(std::uniform_real_distribution<float>(-100, 100)(rng));
      std::memcpy(bytes.data() + 2 * i, &v, 2);
    } else {
      const auto v = int32_t(rng());
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
  }
  return bytes;
}

std::vector<VectorWidth> widths_here() {
  std::vector<VectorWidth> w = {VectorWidth::kPortable};
  if (widest_vector_width() != VectorWidth::kPortable) w.push_back(VectorWidth::kAvx2);
  if (widest_vector_width() == VectorWidth::kAvx512) w.push_back(VectorWidth::kAvx512);
  return w;
}

const char* width_name(VectorWidth w) {
  return w == VectorWidth::kAvx512 ? "AVX-512" : w == VectorWidth::kAvx2 ? "AVX2" : "portable";
}

TEST(ReduceTo, EveryWidthWritesThePortableBitsToBothDestinations) {
  struct Offsets {
    size_t first, second;
  };
  // Both aligned; aligned to 16 only (a malloc'd buffer), as the first or the second; not even
  // aligned to the element; heads of 15 (AVX-512) or 7 (AVX2) elements that leave the other
  // destination aligned to 16 only; a head of 14 or 6 after which the other is aligned to 32
  // (whole AVX2 vectors, AVX-512 pieces); a second aligned to 4 only.
  const Offsets kOffsets[] = {{0, 0}, {16, 0}, {0, 16}, {4, 20}, {1, 3}, {8, 40}, {0, 4}};
  for (VectorWidth width : widths_here()) {
    std::printf("[          ] vector width %s\n", width_name(width));
    for (DType t : {DType::kF32, DType::kBF16, DType::kI32}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        for (size_t count :
             {size_t(0), size_t(1), size_t(15), size_t(17), size_t(1000), size_t(4099)}) {
          const auto a = random_values(t, count, 1), b = random_values(t, count, 2);
          // The reference: reduce() then divide(), as the pipeline did before.
          std::vector<uint8_t> want(a.size());
          reduce(t, op, want.data(), a.data(), b.data(), count);
          if (op == ReduceOp::kAvg) divide(t, want.data(), count, 3);
          for (const Offsets& at : kOffsets) {
            for (int streams = 0; streams < 4; ++streams) {
              for (bool two : {false, true}) {
                Placed first(t, count, at.first), second(t, count, at.second);
                reduce_to(width, t, op, {first.data(), (streams & 1) != 0},
                          {two ? second.data() : nullptr, (streams & 2) != 0},
                          reinterpret_cast<const std::byte*>(a.data()),
                          reinterpret_cast<const std::byte*>(b.data()), count, 3);
                const std::string where =
                    std::string(width_name(width)) + " " + std::string(dtype_name(t)) + " " +
                    std::string(reduce_op_name(op)) + " count " + std::to_string(count) +
                    " offsets " + std::to_string(at.first) + "/" + std::to_string(at.second) +
                    " streams " + std::to_string(streams) + (two ? " two" : " one");
                ASSERT_EQ(first.contents(), want) << where;
                ASSERT_TRUE(first.guards_intact()) << where;
                if (two) {
                  ASSERT_EQ(second.contents(), want) << where;
                }
                ASSERT_TRUE(second.guards_intact()) << where;
              }
            }
          }
        }
      }
    }
  }
}

TEST(ReduceTo, InPlace) {
  // An in-place allreduce's input is its output (the second destination), and an in-place
  // reduce_scatter's output is its input block (the first, alone).
  for (VectorWidth width : widths_here()) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      const size_t count = 1000;
      const auto a = random_values(DType::kF32, count, 3);
      const auto b = random_values(DType::kF32, count, 4);
      std::vector<uint8_t> want(a.size());
      reduce(DType::kF32, op, want.data(), a.data(), b.data(), count);
      if (op == ReduceOp::kAvg) divide(DType::kF32, want.data(), count, 2);
      const auto* peer = reinterpret_cast<const std::byte*>(b.data());
      const std::string where =
          std::string(width_name(width)) + " " + std::string(reduce_op_name(op));

      Placed data(DType::kF32, count, 16), result(DType::kF32, count, 0);
      std::memcpy(data.data(), a.data(), a.size());
      reduce_to(width, DType::kF32, op, {result.data(), true}, {data.data(), true}, data.data(),
                peer, count, 2);
      EXPECT_EQ(data.contents(), want) << where;
      EXPECT_EQ(result.contents(), want) << where;

      Placed block(DType::kF32, count, 16);
      std::memcpy(block.data(), a.data(), a.size());
      reduce_to(width, DType::kF32, op, {block.data(), true}, {}, block.data(), peer, count, 2);
      EXPECT_EQ(block.contents(), want) << where;
    }
  }
}

}  // namespace
}  // namespace wl::comm::detail
