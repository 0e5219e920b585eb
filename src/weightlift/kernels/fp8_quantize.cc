// fp8_quantize.h: block maxima and e4m3 encoding, scalar, AVX2 and AVX-512 (the best the CPU
// has, found once). Each version is two segment functions, the maximum of |x| over columns
// [j0, j1) of a row and the codes of those columns for one scale; the row and band loops
// around them are written once, at the end.
#include "weightlift/kernels/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "weightlift/core/check.h"
#include "weightlift/core/cpu.h"

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

// max |x| over columns [j0, j1) of the row, NaNs skipped; and dst[j] for those columns.
using AmaxSegment = float (*)(DType, const void*, int64_t, int64_t);
using QuantizeSegment = void (*)(DType, const void*, int64_t, int64_t, float, uint8_t*);

float amax_scalar(DType t, const void* row, int64_t j0, int64_t j1) {
  float m = 0.0f;
  for (int64_t j = j0; j < j1; ++j) m = std::max(m, std::fabs(load_scalar(t, row, j)));
  return m;
}

void quantize_scalar(DType t, const void* row, int64_t j0, int64_t j1, float scale, uint8_t* dst) {
  for (int64_t j = j0; j < j1; ++j) dst[j] = f32_to_fp8_e4m3(load_scalar(t, row, j) / scale);
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

WL_AVX2 float amax_avx2(DType t, const void* row, int64_t j0, int64_t j1) {
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
  return std::max(m, amax_scalar(t, row, j, j1));
}

WL_AVX2 void quantize_avx2(DType t, const void* row, int64_t j0, int64_t j1, float scale,
                           uint8_t* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t j = j0;
  for (; j + 32 <= j1; j += 32) {
    const __m256i v0 = encode8(_mm256_div_ps(load8(t, row, j), s));
    const __m256i v1 = encode8(_mm256_div_ps(load8(t, row, j + 8), s));
    const __m256i v2 = encode8(_mm256_div_ps(load8(t, row, j + 16), s));
    const __m256i v3 = encode8(_mm256_div_ps(load8(t, row, j + 24), s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), pack32(v0, v1, v2, v3));
  }
  for (; j + 8 <= j1; j += 8) store8(dst + j, encode8(_mm256_div_ps(load8(t, row, j), s)));
  quantize_scalar(t, row, j, j1, scale, dst);
}

#define WL_AVX512 __attribute__((target("avx512f,avx512bw")))

// The AVX2 functions above at 16 lanes: the same operations, masks instead of blends, and a
// narrowing store instead of the pack.
WL_AVX512 inline __m512 load16(DType t, const void* row, int64_t j) {
  if (t == DType::kBF16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps(static_cast<const float*>(row) + j);
}

WL_AVX512 inline __m128i encode16(__m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), lsb));
  __m512i mag = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
  const __mmask16 subnormal = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x3c800000));
  if (subnormal != 0) {  // rare in weights: |x| below 2^-6 of its block's scale
    const __m512 t =
        _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f), _mm512_set1_ps(8388608.0f));
    mag = _mm512_mask_sub_epi32(mag, subnormal, _mm512_castps_si512(t),
                                _mm512_set1_epi32(0x4b000000));
  }
  // Saturate to 0x7e, except NaNs, which become 0x7f.
  const __mmask16 number = _mm512_cmple_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
  mag = _mm512_mask_min_epi32(_mm512_set1_epi32(0x7f), number, mag, _mm512_set1_epi32(0x7e));
  // mag | (u >> 24 & 0x80): the sign goes on.
  mag = _mm512_ternarylogic_epi32(mag, _mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80), 0xf8);
  return _mm512_cvtepi32_epi8(mag);
}

WL_AVX512 float amax_avx512(DType t, const void* row, int64_t j0, int64_t j1) {
  float m = 0.0f;
  int64_t j = j0;
  if (t == DType::kBF16) {
    const auto* p = static_cast<const uint16_t*>(row);
    __m512i acc = _mm512_setzero_si512();
    for (; j + 32 <= j1; j += 32) {
      const __m512i x = _mm512_and_si512(_mm512_loadu_si512(p + j), _mm512_set1_epi16(0x7fff));
      const __mmask32 number = _mm512_cmplt_epu16_mask(x, _mm512_set1_epi16(0x7f81));
      acc = _mm512_mask_max_epu16(acc, number, acc, x);
    }
    const __m256i h =
        _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    m = bf16_to_f32(uint16_t(hmax_epi16(h)));
  } else {
    const auto* p = static_cast<const float*>(row);
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= j1; j += 16) acc = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p + j)), acc);
    m = _mm512_reduce_max_ps(acc);
  }
  return std::max(m, amax_scalar(t, row, j, j1));
}

WL_AVX512 void quantize_avx512(DType t, const void* row, int64_t j0, int64_t j1, float scale,
                               uint8_t* dst) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     encode16(_mm512_div_ps(load16(t, row, j), s)));
  }
  quantize_scalar(t, row, j, j1, scale, dst);
}
#endif  // __x86_64__

struct Segments {
  AmaxSegment amax;
  QuantizeSegment quantize;
};

Segments segments(Fp8Isa isa) {
  WL_CHECK(isa <= fp8_best_isa()) << "fp8 kernels: this CPU cannot run " << fp8_isa_name(isa);
#if defined(__x86_64__)
  if (isa == Fp8Isa::kAvx512) return {amax_avx512, quantize_avx512};
  if (isa == Fp8Isa::kAvx2) return {amax_avx2, quantize_avx2};
#endif
  return {amax_scalar, quantize_scalar};
}

}  // namespace

Fp8Isa fp8_best_isa() {
#if defined(__x86_64__)
  const CpuInfo& cpu = cpu_info();
  return cpu.avx512f && cpu.avx512bw ? Fp8Isa::kAvx512 : cpu.avx2 ? Fp8Isa::kAvx2 : Fp8Isa::kScalar;
#else
  return Fp8Isa::kScalar;
#endif
}

const char* fp8_isa_name(Fp8Isa isa) {
  switch (isa) {
    case Fp8Isa::kAvx512:
      return "avx512";
    case Fp8Isa::kAvx2:
      return "avx2";
    case Fp8Isa::kScalar:
      break;
  }
  return "scalar";
}

namespace {

// A row's block maxima added into amax, and its codes, on the segments of one version.
void add_row_maxima(const Segments& k, DType t, const void* row, int64_t cols, int64_t block_cols,
                    float* amax) {
  for (int64_t b = 0, j0 = 0; j0 < cols; ++b, j0 += block_cols) {
    amax[b] = std::max(amax[b], k.amax(t, row, j0, std::min(cols, j0 + block_cols)));
  }
}

void quantize_row_on(const Segments& k, DType t, const void* row, int64_t cols, int64_t block_cols,
                     const float* scales, uint8_t* dst) {
  for (int64_t b = 0, j0 = 0; j0 < cols; ++b, j0 += block_cols) {
    k.quantize(t, row, j0, std::min(cols, j0 + block_cols), scales[b], dst);
  }
}

}  // namespace

void fp8_block_amax(DType t, const void* row, int64_t cols, int64_t block_cols, float* amax,
                    Fp8Isa isa) {
  check_source(t);
  WL_CHECK(block_cols > 0) << "block_cols " << block_cols;
  add_row_maxima(segments(isa), t, row, cols, block_cols, amax);
}

void fp8_quantize_row(DType t, const void* row, int64_t cols, int64_t block_cols,
                      const float* scales, uint8_t* dst, Fp8Isa isa) {
  check_source(t);
  WL_CHECK(block_cols > 0) << "block_cols " << block_cols;
  quantize_row_on(segments(isa), t, row, cols, block_cols, scales, dst);
}

void fp8_quantize_band(std::span<const Fp8Row> rows, int64_t cols, int64_t block_cols, uint8_t* dst,
                       float* scales, Fp8Isa isa) {
  for (const Fp8Row& r : rows) check_source(r.dtype);
  WL_CHECK(block_cols > 0) << "block_cols " << block_cols;
  const Segments k = segments(isa);
  // Every row's maxima, then every row's codes: the band (at most 128 rows of a few thousand
  // columns) is in L2 for the second pass. Tried and not kept: block column by block column
  // with the next one prefetched (8% faster at 1024 bf16 columns, 12% slower at 2048, whose
  // 4 KiB row pitch puts a block's 128 rows in a few L1 sets), and prefetching the next band
  // during the codes pass (7% faster, for an address list threaded through the executor).
  const int64_t nb = (cols + block_cols - 1) / block_cols;
  std::fill(scales, scales + nb, 0.0f);  // the maxima first
  for (const Fp8Row& r : rows) add_row_maxima(k, r.dtype, r.data, cols, block_cols, scales);
  for (int64_t b = 0; b < nb; ++b) scales[b] = fp8_scale(scales[b]);
  for (size_t i = 0; i < rows.size(); ++i) {
    quantize_row_on(k, rows[i].dtype, rows[i].data, cols, block_cols, scales,
                    dst + int64_t(i) * cols);
  }
}

}  // namespace wl::kernels
