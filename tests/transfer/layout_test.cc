// The inference layout against the independent reference transform (same names, dtypes and
// shapes; slices that tile every receiver row), the reference's fp8 against the format's own
// error bound, the executor's band quantizer against the reference bit for bit (and its AVX2
// kernel against the scalar definition on the edge values: zeros, subnormals, rounding ties,
// the saturation point, infinities, NaNs, every e4m3 code), and shard row ranges.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "fixture.h"
#include "weightlift/kernels/fp8_quantize.h"
#include "weightlift/transfer/layout/fp8_blocks.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "weightlift/transfer/layout/sharded_tensor.h"

namespace wl::transfer {
namespace {

using testing::preset_or_die;
using testing::random_weights;

TEST(InferenceLayout, MatchesTheReferenceTensorForTensor) {
  for (const char* preset : {"tiny", "small", "tiny-qwen3-moe"}) {
    const model::ModelConfig c = preset_or_die(preset);
    const std::vector<float> w = random_weights(c, 7);
    for (int tp : {1, 2, 4}) {
      for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
        for (int r = 0; r < tp; ++r) {
          auto lay = inference_layout(c, {.tp = tp, .tp_rank = r, .format = f});
          ASSERT_TRUE(lay.ok()) << lay.status().to_string();
          auto ref = reference_receiver_tensors(c, {.tp = tp, .tp_rank = r, .format = f}, w);
          ASSERT_EQ(lay->size(), ref.size()) << preset << " tp " << tp;
          for (const ReceiverTensor& t : *lay) {
            SCOPED_TRACE(t.name);
            ASSERT_TRUE(ref.count(t.name));
            EXPECT_EQ(ref[t.name].dtype, t.dtype);
            EXPECT_EQ(ref[t.name].shape, t.shape);
            EXPECT_EQ(ref[t.name].bytes.size(), t.nbytes());
            int64_t row = 0;
            for (const SourceSlice& s : t.sources) {
              EXPECT_EQ(s.dst_row, row);
              EXPECT_EQ(s.col_end - s.col_begin, t.cols);
              row += s.rows();
            }
            EXPECT_EQ(row, t.sources.empty() ? 0 : t.rows);
          }
        }
      }
    }
  }
}

TEST(InferenceLayout, RefusesTpThatDoesNotDivide) {
  const model::ModelConfig c = preset_or_die("tiny");  // 4 heads, 1 kv head, ffn 128
  auto three = inference_layout(c, {.tp = 3});
  ASSERT_FALSE(three.ok());
  EXPECT_EQ(three.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(three.status().message().find("does not divide num_heads 4"), std::string::npos)
      << three.status().message();
  EXPECT_FALSE(inference_layout(c, {.tp = 8}).ok());  // 8 does not divide 4 heads
  EXPECT_FALSE(inference_layout(c, {.tp = 2, .tp_rank = 2}).ok());
}

TEST(InferenceLayout, KvHeadsBelowTpAreReplicated) {
  const model::ModelConfig c = preset_or_die("tiny");
  for (int r = 0; r < 4; ++r) {
    auto lay = inference_layout(c, {.tp = 4, .tp_rank = r});
    ASSERT_TRUE(lay.ok());
    for (const ReceiverTensor& t : *lay) {
      if (t.name != "layers.0.attn.qkv_proj.weight") continue;
      ASSERT_EQ(t.sources.size(), 3u);
      EXPECT_EQ(t.sources[0].row_begin, r * 16);  // one query head of 16 rows each
      EXPECT_EQ(t.sources[1].row_begin, 0);       // the single kv head, on every rank
      EXPECT_EQ(t.sources[2].row_begin, 0);
    }
  }
}

// The reference's fp8 agrees with what e4m3 can represent: each value dequantizes to within
// half an e4m3 step of itself (3 mantissa bits: relative 2^-4 for normals; below the
// smallest normal 2^-6 the step is 2^-9 of the scale), and each block's amax to itself.
TEST(ReferenceTransform, Fp8DequantizesWithinHalfAStep) {
  const model::ModelConfig c = preset_or_die("small");
  const std::vector<float> w = random_weights(c, 3);
  const model::ParamLayout layout(c);
  auto ref = reference_receiver_tensors(c, {.tp = 1, .format = WeightFormat::kFP8}, w);
  const ReferenceTensor& q = ref.at("layers.1.moe.experts.2.down_proj.weight");
  const ReferenceTensor& s = ref.at("layers.1.moe.experts.2.down_proj.weight.scale");
  const model::ParamInfo& p = layout.at("layers.1.moe.experts.2.down_proj.weight");
  const int64_t rows = p.shape[0], cols = p.shape[1], bc = s.shape[1];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      float scale;
      std::memcpy(&scale, s.bytes.data() + 4 * ((i / 128) * bc + j / 128), 4);
      const float x = w[size_t(p.offset + i * cols + j)];
      const float y = fp8_e4m3_to_f32(uint8_t(q.bytes[size_t(i * cols + j)])) * scale;
      const float bound = std::max(std::fabs(x) * 0x1p-4f, scale * 0x1p-10f);
      ASSERT_LE(std::fabs(x - y), bound) << i << "," << j;
    }
  }
  // The all-zero down_proj of layer 0, expert 1: scale 1, every byte +0.
  const ReferenceTensor& zs = ref.at("layers.0.moe.experts.1.down_proj.weight.scale");
  for (size_t k = 0; k < zs.bytes.size(); k += 4) {
    float v;
    std::memcpy(&v, zs.bytes.data() + k, 4);
    EXPECT_EQ(v, 1.0f);
  }
}

TEST(Fp8Blocks, BandQuantizerMatchesTheReferenceBitForBit) {
  const model::ModelConfig c = preset_or_die("small");
  const std::vector<float> w = random_weights(c, 11);
  const model::ParamLayout layout(c);
  auto ref =
      reference_receiver_tensors(c, {.tp = 2, .tp_rank = 1, .format = WeightFormat::kFP8}, w);
  // o_proj at tp 2, rank 1: [256, 128], the input columns [128, 256).
  const model::ParamInfo& p = layout.at("layers.2.attn.o_proj.weight");
  const ReferenceTensor& q = ref.at("layers.2.attn.o_proj.weight");
  const ReferenceTensor& s = ref.at("layers.2.attn.o_proj.weight.scale");
  for (int64_t band = 0; band < 2; ++band) {
    std::vector<float> src(128 * 128);
    for (int64_t i = 0; i < 128; ++i) {
      for (int64_t j = 0; j < 128; ++j) {
        src[size_t(i * 128 + j)] = w[size_t(p.offset + (band * 128 + i) * 256 + 128 + j)];
      }
    }
    std::vector<uint8_t> out(128 * 128);
    float scale = 0;
    quantize_fp8_band(src.data(), 128, 128, out.data(), &scale);
    EXPECT_EQ(std::memcmp(out.data(), q.bytes.data() + band * 128 * 128, out.size()), 0);
    EXPECT_EQ(std::memcmp(&scale, s.bytes.data() + band * 4, 4), 0);
    // The same band read as bf16 rows straight from where they lie (the rows of `w` here are
    // not bf16-exact, so compare with the band rounded to bf16 first, in f32).
    std::vector<uint16_t> half(src.size());
    std::vector<float> rounded(src.size());
    convert_f32_to_bf16(src.data(), half.data(), src.size());
    convert_bf16_to_f32(half.data(), rounded.data(), src.size());
    std::vector<BandRow> rows;
    for (int64_t i = 0; i < 128; ++i) rows.push_back({half.data() + i * 128, DType::kBF16});
    std::vector<uint8_t> from_bf16(out.size()), from_f32(out.size());
    float s16 = 0, s32 = 0;
    quantize_fp8_band(rows, 128, from_bf16.data(), &s16);
    quantize_fp8_band(rounded.data(), 128, 128, from_f32.data(), &s32);
    EXPECT_EQ(from_bf16, from_f32);
    EXPECT_EQ(s16, s32);
  }
}

// The definition, written out: what the band quantizer must reproduce bit for bit.
void reference_band(const std::vector<float>& x, int64_t rows, int64_t cols,
                    std::vector<uint8_t>* q, std::vector<float>* scales) {
  const int64_t nb = (cols + 127) / 128;
  scales->assign(size_t(nb), 0.0f);
  q->assign(size_t(rows * cols), 0);
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = b * 128; j < std::min(cols, (b + 1) * 128); ++j) {
        amax = std::max(amax, std::fabs(x[size_t(i * cols + j)]));
      }
    }
    const float s = amax == 0.0f ? 1.0f : amax / 448.0f;
    (*scales)[size_t(b)] = s;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = b * 128; j < std::min(cols, (b + 1) * 128); ++j) {
        (*q)[size_t(i * cols + j)] = f32_to_fp8_e4m3(x[size_t(i * cols + j)] / s);
      }
    }
  }
}

// Values where an encoder goes wrong: signed zeros, f32 subnormals, e4m3 subnormals and the
// ties between them, the normal/subnormal boundary 2^-6, ties between normals, the largest
// finite 448, the tie 464 (rounds to 448: 480 would be the NaN code), values that saturate,
// infinities and NaNs of both signs.
std::vector<float> edge_values() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1e-45f,
                          -1e-45f,
                          1e-40f,
                          1.17549435e-38f,
                          std::ldexp(1.0f, -9),
                          std::ldexp(1.0f, -10),
                          std::ldexp(3.0f, -10),
                          std::ldexp(5.0f, -10),
                          std::ldexp(15.0f, -10),
                          std::ldexp(7.0f, -9),
                          std::ldexp(7.5f, -9),
                          std::nextafter(std::ldexp(1.0f, -6), 0.0f),
                          std::ldexp(1.0f, -6),
                          std::ldexp(1.0625f, -6),
                          std::ldexp(1.0625f, 0),
                          std::ldexp(1.1875f, 0),
                          1.0f,
                          448.0f,
                          456.0f,
                          464.0f,
                          std::nextafter(464.0f, 0.0f),
                          std::nextafter(464.0f, inf),
                          480.0f,
                          1e30f,
                          3.4028235e38f,
                          inf,
                          nan,
                          -nan};
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return v;
}

// Every version of the fp8 kernels this CPU runs, the scalar definition first.
std::vector<kernels::Fp8Isa> isas_here() {
  std::vector<kernels::Fp8Isa> v;
  for (auto isa : {kernels::Fp8Isa::kScalar, kernels::Fp8Isa::kAvx2, kernels::Fp8Isa::kAvx512}) {
    if (isa <= kernels::fp8_best_isa()) v.push_back(isa);
  }
  return v;
}

TEST(Fp8Blocks, KernelEncodesEdgeValuesAsTheScalarDefinition) {
  std::vector<float> x = edge_values();
  std::mt19937 rng(5);
  // Random bit patterns over every exponent, NaNs and infinities included.
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = rng();
    x.push_back(f32_from_bits(u));
  }
  for (int i = 0; i < 4; ++i) x.push_back(1.0f);  // an odd tail for the scalar remainder
  const int64_t n = int64_t(x.size());
  const int64_t blocks = (n + 127) / 128;
  for (float scale : {1.0f, 0.37f, 3.0e-3f, 1.0f / 448.0f, 7.0f}) {
    const std::vector<float> scales(size_t(blocks), scale);
    for (kernels::Fp8Isa isa : isas_here()) {
      std::vector<uint8_t> q(static_cast<size_t>(n));
      kernels::fp8_quantize_row(DType::kF32, x.data(), n, 128, scales.data(), q.data(), isa);
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t want = f32_to_fp8_e4m3(x[size_t(j)] / scale);
        ASSERT_EQ(int(q[size_t(j)]), int(want))
            << kernels::fp8_isa_name(isa) << ": x " << x[size_t(j)] << " (bits " << std::hex
            << f32_bits(x[size_t(j)]) << ") scale " << scale;
      }
    }
  }
  RecordProperty("best_isa", kernels::fp8_isa_name(kernels::fp8_best_isa()));
}

TEST(Fp8Blocks, EveryCodeRoundTrips) {
  // Each of the 256 codes decoded, then encoded with scale 1, from f32 and from bf16 (every
  // e4m3 value is a bf16 value): the same code, NaNs keeping their sign.
  std::vector<float> x(256);
  std::vector<uint16_t> h(256);
  for (int c = 0; c < 256; ++c) {
    x[size_t(c)] = fp8_e4m3_to_f32(uint8_t(c));
    h[size_t(c)] = f32_to_bf16(x[size_t(c)]);
  }
  const std::vector<float> ones(2, 1.0f);
  for (DType t : {DType::kF32, DType::kBF16}) {
    const void* src = t == DType::kF32 ? static_cast<const void*>(x.data()) : h.data();
    for (kernels::Fp8Isa isa : isas_here()) {
      std::vector<uint8_t> q(256);
      kernels::fp8_quantize_row(t, src, 256, 128, ones.data(), q.data(), isa);
      for (int c = 0; c < 256; ++c)
        EXPECT_EQ(int(q[size_t(c)]), c) << dtype_name(t) << " " << kernels::fp8_isa_name(isa);
    }
  }
}

// A band of rows x cols whose 128-column blocks cycle through six kinds: small values, all
// zero, all subnormal, holding 448 exactly, holding edge values (infinities among them), and
// holding NaNs.
std::vector<float> band_of_edges(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const std::vector<float> edges = edge_values();
  std::vector<float> x(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      float& v = x[size_t(i * cols + j)];
      switch ((j / 128) % 6) {
        case 0:
          v = uni(rng) * 0.05f;
          break;
        case 1:
          v = 0.0f;
          break;
        case 2:
          v = uni(rng) * 1e-39f;
          break;
        case 3:
          v = (i + j) % 17 == 0 ? 448.0f : uni(rng) * 3.0f;
          break;
        case 4:
          v = (i + j) % 11 == 0 ? edges[size_t(i + j) % edges.size()] : uni(rng);
          break;
        default:
          v = (i * 7 + j) % 29 == 0 ? std::numeric_limits<float>::quiet_NaN() : uni(rng) * 100.0f;
      }
    }
  }
  return x;
}

// Every kernel version on the band at `base` (rows x cols of dtype t, contiguous), by whole
// bands and row by row, against the reference codes and scales.
void check_every_version(const void* base, DType t, int64_t rows, int64_t cols,
                         const std::vector<uint8_t>& want_q, const std::vector<float>& want_s) {
  const int64_t nb = (cols + 127) / 128;
  std::vector<kernels::Fp8Row> band;
  for (int64_t i = 0; i < rows; ++i) {
    band.push_back({static_cast<const std::byte*>(base) + i * cols * dtype_size(t), t});
  }
  for (kernels::Fp8Isa isa : isas_here()) {
    const std::string where = std::string(kernels::fp8_isa_name(isa)) + " " + std::to_string(rows) +
                              "x" + std::to_string(cols) + " " + std::string(dtype_name(t));
    std::vector<uint8_t> bq(want_q.size()), rq(want_q.size());
    std::vector<float> bs(static_cast<size_t>(nb)), rs(static_cast<size_t>(nb));
    std::vector<float> maxima(static_cast<size_t>(nb), 0.0f);
    kernels::fp8_quantize_band(band, cols, 128, bq.data(), bs.data(), isa);
    for (const kernels::Fp8Row& r : band)
      kernels::fp8_block_amax(t, r.data, cols, 128, maxima.data(), isa);
    for (int64_t b = 0; b < nb; ++b) rs[size_t(b)] = kernels::fp8_scale(maxima[size_t(b)]);
    for (int64_t i = 0; i < rows; ++i) {
      kernels::fp8_quantize_row(t, band[size_t(i)].data, cols, 128, rs.data(), rq.data() + i * cols,
                                isa);
    }
    EXPECT_EQ(bq, want_q) << where << ", by bands";
    EXPECT_EQ(rq, want_q) << where << ", by rows";
    EXPECT_EQ(std::memcmp(bs.data(), want_s.data(), bs.size() * 4), 0) << where;
    EXPECT_EQ(std::memcmp(rs.data(), want_s.data(), rs.size() * 4), 0) << where;
  }
}

TEST(Fp8Blocks, BandEdgesMatchTheDefinition) {
  // Bands of 1, 7 and 128 rows; 13, 128, 200 and 1000 columns (short last blocks, tails of
  // the 8- and 32-wide loops); blocks that are all zero, all subnormal, hold 448 exactly,
  // hold an infinity (its scale is inf: every finite value becomes 0 and the inf NaN), or
  // hold NaNs (skipped by the maximum, encoded as NaN).
  std::mt19937 rng(9);
  for (int64_t rows : {1, 7, 128}) {
    for (int64_t cols : {13, 128, 200, 1000}) {
      const std::vector<float> x = band_of_edges(rows, cols, rng);
      std::vector<uint8_t> want_q;
      std::vector<float> want_s;
      reference_band(x, rows, cols, &want_q, &want_s);
      std::vector<uint8_t> q(x.size());
      std::vector<float> s(want_s.size());
      quantize_fp8_band(x.data(), rows, cols, q.data(), s.data());
      EXPECT_EQ(q, want_q) << rows << "x" << cols;
      EXPECT_EQ(std::memcmp(s.data(), want_s.data(), s.size() * 4), 0) << rows << "x" << cols;
      check_every_version(x.data(), DType::kF32, rows, cols, want_q, want_s);
      // From bf16, whose reference is the band widened back to f32.
      std::vector<uint16_t> h(x.size());
      convert_f32_to_bf16(x.data(), h.data(), x.size());
      std::vector<float> wide(x.size());
      for (size_t i = 0; i < x.size(); ++i) wide[i] = bf16_to_f32(h[i]);
      std::vector<uint8_t> want_hq;
      std::vector<float> want_hs;
      reference_band(wide, rows, cols, &want_hq, &want_hs);
      check_every_version(h.data(), DType::kBF16, rows, cols, want_hq, want_hs);
    }
  }
}

TEST(ShardRows, FollowTorchChunk) {
  // 10 rows over 4 ranks: chunks of 3, the last rank gets 1.
  EXPECT_EQ(shard_rows(10, 4, 0).begin, 0);
  EXPECT_EQ(shard_rows(10, 4, 2).end, 9);
  EXPECT_EQ(shard_rows(10, 4, 3).size(), 1);
  // 2 rows over 4 ranks: ranks 2 and 3 hold nothing.
  EXPECT_EQ(shard_rows(2, 4, 1).size(), 1);
  EXPECT_EQ(shard_rows(2, 4, 2).size(), 0);
  EXPECT_EQ(shard_rows(2, 4, 3).size(), 0);
  for (int64_t rows : {1, 7, 64, 65}) {
    int64_t covered = 0;
    for (int r = 0; r < 3; ++r) covered += shard_rows(rows, 3, r).size();
    EXPECT_EQ(covered, rows);
  }
}

TEST(RowSplit, EvenIsTorchChunkAndOthersMustFollowInRankOrder) {
  const RowSplit even = RowSplit::even(10, 4);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(even.rank_rows(r), shard_rows(10, 4, r));
  // A stage holding a whole parameter, the ranks around it none.
  const std::vector<ShardRows> staged = {{0, 0}, {0, 10}, {10, 10}};
  auto split = RowSplit::of(staged, 10, "w");
  ASSERT_TRUE(split.ok()) << split.status().to_string();
  EXPECT_EQ(split->rank_rows(1).size(), 10);
  EXPECT_EQ(split->rank_rows(2).size(), 0);
  EXPECT_EQ(split->ranks(), 3);
  // A gap, an overlap, rows out of rank order, too few rows: each refused, naming the rank.
  const std::vector<std::pair<std::vector<ShardRows>, std::string>> bad = {
      {{{0, 4}, {5, 10}}, "rank 1 holds rows [5, 10)"},
      {{{0, 6}, {5, 10}}, "rank 1 holds rows [5, 10)"},
      {{{5, 10}, {0, 5}}, "rank 0 holds rows [5, 10)"},
      {{{0, 4}, {4, 9}}, "the ranks hold rows [0, 9) of 10"}};
  for (const auto& [rows, words] : bad) {
    auto refused = RowSplit::of(rows, 10, "layers.0.w");
    ASSERT_FALSE(refused.ok()) << words;
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find(words), std::string::npos)
        << refused.status().message();
    EXPECT_NE(refused.status().message().find("layers.0.w"), std::string::npos);
  }
}

}  // namespace
}  // namespace wl::transfer
