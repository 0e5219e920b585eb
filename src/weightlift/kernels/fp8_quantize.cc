// fp8_quantize.h: block maxima and e4m3 encoding, scalar and AVX2 (chosen once, at first use).
#include "weightlift/kernels/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "weightlift/core/check.h"

namespace wl::kernels {
namespace {

inline float load_scalar(DType t, const void* row, int64_t j) {
  if (t == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(row)[j]);
  return static_cast<const float*>(row)[j];
}

void check_source(DType t) {
  WL_CHECK(t == DType::kF32 || t == DType::kBF16)
      << "fp8 quantization reads f32 or bf16, not " << dtype_name(t);
}

#if defined(__x86_64__)
#define WL_AVX2 __attribute__((target("avx2")))

// 8 elements of the row at column j as f32 (bf16 widens exactly: its bits are the top half).
WL_AVX2 inline __m256 load8(DType t, const void* row, int64_t j) {
  if (t == DType::kBF16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + j));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(row) + j);
}

// The e4m3 code of each lane of y, in the low byte of each 32-bit lane (see the header).
WL_AVX2 inline __m256i encode8(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), lsb));
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)),
                                 _mm256_set1_ps(8388608.0f));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4b000000));
  const __m256i is_normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x3c7fffff));
  __m256i mag = _mm256_blendv_epi8(sub, normal, is_normal);
  mag = _mm256_min_epi32(mag, _mm256_set1_epi32(0x7e));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  mag = _mm256_or_si256(mag, _mm256_and_si256(nan, _mm256_set1_epi32(0x7f)));
  return _mm256_or_si256(mag, sign);
}

// Four vectors of codes (0..255 in 32-bit lanes) as 32 bytes in element order.
WL_AVX2 inline __m256i pack32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(v0, v1), _mm256_packus_epi32(v2, v3));
  // b's dwords: v0[0:4] v1[0:4] v2[0:4] v3[0:4] | v0[4:8] v1[4:8] v2[4:8] v3[4:8].
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

WL_AVX2 inline void store8(uint8_t* dst, __m256i v) {
  const __m256i p = pack32(v, v, v, v);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(p));
}

WL_AVX2 inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

WL_AVX2 inline int hmax_epi16(__m256i v) {
  __m128i m = _mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi16(m, _mm_srli_si128(m, 8));
  m = _mm_max_epi16(m, _mm_srli_si128(m, 4));
  m = _mm_max_epi16(m, _mm_srli_si128(m, 2));
  return _mm_extract_epi16(m, 0);
}

WL_AVX2 void block_amax_avx2(DType t, const void* row, int64_t cols, int64_t block_cols,
                             float* amax) {
  for (int64_t b = 0, j0 = 0; j0 < cols; ++b, j0 += block_cols) {
    const int64_t j1 = std::min(cols, j0 + block_cols);
    float m = 0.0f;
    int64_t j = j0;
    if (t == DType::kBF16) {
      // Magnitudes compare as integers; NaN magnitudes (above 0x7f80) are zeroed first.
      const auto* p = static_cast<const uint16_t*>(row);
      __m256i acc = _mm256_setzero_si256();
      for (; j + 16 <= j1; j += 16) {
        __m256i x = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j)),
                                     _mm256_set1_epi16(0x7fff));
        x = _mm256_and_si256(x, _mm256_cmpgt_epi16(_mm256_set1_epi16(0x7f81), x));
        acc = _mm256_max_epi16(acc, x);
      }
      m = bf16_to_f32(uint16_t(hmax_epi16(acc)));
    } else {
      // max_ps(|x|, acc) returns acc when x is NaN: the NaN is skipped.
      const auto* p = static_cast<const float*>(row);
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 acc = _mm256_setzero_ps();
      for (; j + 8 <= j1; j += 8) {
        acc = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p + j), abs_mask), acc);
      }
      m = hmax_ps(acc);
    }
    for (; j < j1; ++j) m = std::max(m, std::fabs(load_scalar(t, row, j)));
    amax[b] = std::max(amax[b], m);
  }
}

WL_AVX2 void quantize_row_avx2(DType t, const void* row, int64_t cols, int64_t block_cols,
                               const float* scales, uint8_t* dst) {
  for (int64_t b = 0, j0 = 0; j0 < cols; ++b, j0 += block_cols) {
    const int64_t j1 = std::min(cols, j0 + block_cols);
    const __m256 s = _mm256_set1_ps(scales[b]);
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
      const __m256i v0 = encode8(_mm256_div_ps(load8(t, row, j), s));
      const __m256i v1 = encode8(_mm256_div_ps(load8(t, row, j + 8), s));
      const __m256i v2 = encode8(_mm256_div_ps(load8(t, row, j + 16), s));
      const __m256i v3 = encode8(_mm256_div_ps(load8(t, row, j + 24), s));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), pack32(v0, v1, v2, v3));
    }
    for (; j + 8 <= j1; j += 8) store8(dst + j, encode8(_mm256_div_ps(load8(t, row, j), s)));
    for (; j < j1; ++j) dst[j] = f32_to_fp8_e4m3(load_scalar(t, row, j) / scales[b]);
  }
}

bool has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif  // __x86_64__

}  // namespace

void fp8_block_amax_scalar(DType t, const void* row, int64_t cols, int64_t block_cols,
                           float* amax) {
  check_source(t);
  for (int64_t b = 0, j0 = 0; j0 < cols; ++b, j0 += block_cols) {
    const int64_t j1 = std::min(cols, j0 + block_cols);
    float m = amax[b];
    for (int64_t j = j0; j < j1; ++j) m = std::max(m, std::fabs(load_scalar(t, row, j)));
    amax[b] = m;
  }
}

void fp8_quantize_row_scalar(DType t, const void* row, int64_t cols, int64_t block_cols,
                             const float* scales, uint8_t* dst) {
  check_source(t);
  for (int64_t j = 0; j < cols; ++j) {
    dst[j] = f32_to_fp8_e4m3(load_scalar(t, row, j) / scales[j / block_cols]);
  }
}

bool fp8_quantize_is_vectorised() {
#if defined(__x86_64__)
  return has_avx2();
#else
  return false;
#endif
}

void fp8_block_amax(DType t, const void* row, int64_t cols, int64_t block_cols, float* amax) {
  check_source(t);
#if defined(__x86_64__)
  if (has_avx2()) return block_amax_avx2(t, row, cols, block_cols, amax);
#endif
  fp8_block_amax_scalar(t, row, cols, block_cols, amax);
}

void fp8_quantize_row(DType t, const void* row, int64_t cols, int64_t block_cols,
                      const float* scales, uint8_t* dst) {
  check_source(t);
  WL_CHECK(block_cols > 0 && block_cols % 8 == 0) << "block_cols " << block_cols;
#if defined(__x86_64__)
  if (has_avx2()) return quantize_row_avx2(t, row, cols, block_cols, scales, dst);
#endif
  fp8_quantize_row_scalar(t, row, cols, block_cols, scales, dst);
}

}  // namespace wl::kernels
