// The inference layout against the independent reference transform (same names, dtypes and
// shapes; slices that tile every receiver row), the reference's fp8 against the format's own
// error bound, the executor's band quantizer against the reference bit for bit, and shard
// row ranges.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fixture.h"
#include "weightlift/transfer/fp8_blocks.h"
#include "weightlift/transfer/inference_layout.h"
#include "weightlift/transfer/reference.h"
#include "weightlift/transfer/sharded_tensor.h"

namespace wl::transfer {
namespace {

using testing::preset_or_die;
using testing::random_weights;

TEST(InferenceLayout, MatchesTheReferenceTensorForTensor) {
  for (const char* preset : {"tiny", "small"}) {
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
  auto ref = reference_receiver_tensors(c, {.tp = 2, .tp_rank = 1, .format = WeightFormat::kFP8}, w);
  // o_proj at tp 2, rank 1: [256, 128], the input columns [128, 256).
  const model::ParamInfo& p = layout.at("layers.2.attn.o_proj.weight");
  const ReferenceTensor& q = ref.at("layers.2.attn.o_proj.weight");
  const ReferenceTensor& s = ref.at("layers.2.attn.o_proj.weight.scale");
  for (int64_t band = 0; band < 2; ++band) {
    std::vector<float> src(128 * 128), tmp(128);
    for (int64_t i = 0; i < 128; ++i) {
      for (int64_t j = 0; j < 128; ++j) {
        src[size_t(i * 128 + j)] = w[size_t(p.offset + (band * 128 + i) * 256 + 128 + j)];
      }
    }
    std::vector<uint8_t> out(128 * 128);
    float scale = 0;
    quantize_fp8_band(src.data(), 128, 128, out.data(), &scale, tmp.data());
    EXPECT_EQ(std::memcmp(out.data(), q.bytes.data() + band * 128 * 128, out.size()), 0);
    EXPECT_EQ(std::memcmp(&scale, s.bytes.data() + band * 4, 4), 0);
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

}  // namespace
}  // namespace wl::transfer
