// Element types and their conversions.
//
// bf16 and f16 follow IEEE round-to-nearest-even. The fp8 formats are the OCP ones that
// DeepSeek-V3, vLLM and CUDA use:
//   e4m3 ("e4m3fn"): bias 7, no infinities, max finite 448, S.1111.111 is NaN.
//   e5m2:            bias 15, IEEE-like with inf and NaN, max finite 57344.
// f32 -> fp8 rounds to nearest even and *saturates*: finite values beyond the largest finite
// value, and infinities, become +-max (CUDA's satfinite). NaN stays NaN. f32 -> f16 and
// f32 -> bf16 do not saturate: overflow becomes inf, as IEEE says.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace wl {

enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3, kF8E5M2, kI64, kI32, kU8 };

size_t dtype_size(DType t);            // bytes per element
std::string_view dtype_name(DType t);  // safetensors spelling: "F32", "BF16", "F8_E4M3", ...
std::optional<DType> dtype_from_name(std::string_view name);  // inverse of dtype_name
bool dtype_is_float(DType t);

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---- bf16: the top 16 bits of an f32 -------------------------------------------------------
inline float bf16_to_f32(uint16_t b) { return f32_from_bits(uint32_t(b) << 16); }
inline uint16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return uint16_t(u >> 16);
}

// ---- f16, e4m3, e5m2 ----------------------------------------------------------------------
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float x);
float fp8_e4m3_to_f32(uint8_t v);
uint8_t f32_to_fp8_e4m3(float x);
float fp8_e5m2_to_f32(uint8_t v);
uint8_t f32_to_fp8_e5m2(float x);

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

// Bulk conversions; `n` elements, buffers must not overlap. Vectorised where the CPU allows.
void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n);
void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n);
void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n);
void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n);
void convert_f32_to_fp8_e4m3(const float* src, uint8_t* dst, size_t n);
void convert_fp8_e4m3_to_f32(const uint8_t* src, float* dst, size_t n);

// dst[i] = src[i] rounded to the nearest value of `t` (kBF16 or kF16), kept as f32: what a
// GEMM over operands of that type sees. Uses F16C when the CPU has it. May run in place.
void round_through(DType t, const float* src, float* dst, size_t n);

// Any float dtype to/from f32; `src`/`dst` are raw buffers of the given dtype.
void convert_to_f32(DType src_type, const void* src, float* dst, size_t n);
void convert_from_f32(const float* src, DType dst_type, void* dst, size_t n);

}  // namespace wl
