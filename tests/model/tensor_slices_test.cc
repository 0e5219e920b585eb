// The tensor-parallel split (tensor_slices.h): each rank's slices are an ordinary model of
// tp_config, the owned slices cover every element of every parameter exactly once, and
// slicing then putting the owned slices back gives the whole model.
#include "weightlift/model/tensor_slices.h"

#include <gtest/gtest.h>

#include <vector>

namespace wl::model {
namespace {

ModelConfig tiny_gqa() {  // two kv heads: split at tp 2, replicated at tp 4
  ModelConfig c = *preset("tiny");
  c.num_kv_heads = 2;
  return c;
}

struct Case {
  ModelConfig config;
  int tp;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {1, 2, 4}) out.push_back({*preset("tiny"), tp});
  for (int tp : {2, 4}) out.push_back({tiny_gqa(), tp});
  for (int tp : {2, 4, 8}) out.push_back({*preset("small"), tp});
  for (int tp : {2, 3, 4, 6, 12}) out.push_back({*preset("seed-6.9b"), tp});
  return out;
}

bool overlap(const TensorSlice& a, const TensorSlice& b) {
  auto cross = [](ShardRows x, ShardRows y) { return x.begin < y.end && y.begin < x.end; };
  return cross(a.rows, b.rows) && cross(a.cols, b.cols);
}

TEST(TensorSlices, OwnedSlicesTileEveryParameterOnceAndEachRankIsAModel) {
  for (const Case& k : cases()) {
    ASSERT_TRUE(check_tensor_parallel(k.config, k.tp, "test").ok());
    const ParamLayout global(k.config);
    const ParamLayout local(tp_config(k.config, k.tp));
    ASSERT_EQ(local.params().size(), global.params().size());
    for (size_t i = 0; i < global.params().size(); ++i) {
      const ParamInfo& p = global.params()[i];
      const int64_t rows = p.shape[0], cols = p.numel() / rows;
      std::vector<TensorSlice> owned;
      for (int r = 0; r < k.tp; ++r) {
        const TensorSlice s = tensor_slice(k.config, p, k.tp, r);
        const ParamInfo& l = local.params()[i];
        ASSERT_EQ(l.name, p.name);
        // The local parameter is the band, as a dense [rows, cols] matrix.
        EXPECT_EQ(l.shape[0], s.rows.size()) << p.name << " tp " << k.tp;
        EXPECT_EQ(l.numel(), s.rows.size() * s.cols.size()) << p.name << " tp " << k.tp;
        EXPECT_TRUE(s.rows.begin >= 0 && s.rows.end <= rows && s.cols.begin >= 0 &&
                    s.cols.end <= cols)
            << p.name;
        if (k.tp == 1) {
          EXPECT_TRUE(s.owner && s.rows.size() == rows && s.cols.size() == cols) << p.name;
        }
        if (!s.owner) continue;
        for (const TensorSlice& o : owned) EXPECT_FALSE(overlap(o, s)) << p.name << " rank " << r;
        owned.push_back(s);
      }
      int64_t area = 0;
      for (const TensorSlice& s : owned) area += s.rows.size() * s.cols.size();
      EXPECT_EQ(area, p.numel()) << p.name << " tp " << k.tp;
    }
  }
}

TEST(TensorSlices, SlicingThenUnslicingTheOwnedPartsGivesTheModelBack) {
  for (const Case& k : cases()) {
    if (k.config.hidden_size > 64) continue;  // tiny ones; the test above covers the rest
    const ParamLayout global(k.config);
    const ModelConfig lc = tp_config(k.config, k.tp);
    const ParamLayout local(lc);
    std::vector<float> whole(size_t(global.total()));
    init_params(k.config, global, 11, whole.data());
    std::vector<float> back(whole.size(), -1.0f);
    std::vector<size_t> all(global.params().size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    for (int r = 0; r < k.tp; ++r) {
      std::vector<float> mine(size_t(local.total()));
      slice_params(k.config, global, local, k.tp, r, whole.data(), mine.data());
      // Rank r's q_proj is the rows of its heads.
      const ParamInfo& q = global.at("layers.0.attn.q_proj.weight");
      const int64_t first = r * lc.num_heads * lc.head_dim * k.config.hidden_size;
      EXPECT_EQ(mine[size_t(local.at(q.name).offset)], whole[size_t(q.offset + first)]);
      unslice_owned(k.config, global, local, k.tp, r, all, mine.data(), back.data());
    }
    EXPECT_EQ(back, whole) << "tp " << k.tp << " kv heads " << k.config.num_kv_heads;
  }
}

TEST(TensorSlices, AKvHeadShortOfTheRanksIsHeldByEachOfItsGroupAndOwnedByTheFirst) {
  const ModelConfig c = tiny_gqa();  // 2 kv heads over 4 ranks: heads 0, 0, 1, 1
  EXPECT_EQ(kv_copies(c, 4), 2);
  EXPECT_EQ(kv_copies(c, 2), 1);
  const ParamLayout layout(c);
  const ParamInfo& k = layout.at("layers.1.attn.k_proj.weight");
  const int64_t dh = c.head_dim;
  for (int r = 0; r < 4; ++r) {
    const TensorSlice s = tensor_slice(c, k, 4, r);
    EXPECT_EQ(s.rows.begin, r / 2 * dh) << r;
    EXPECT_EQ(s.rows.size(), dh) << r;
    EXPECT_EQ(s.owner, r % 2 == 0) << r;
  }
}

TEST(TensorSlices, ASplitThatDoesNotDivideSaysWhich) {
  const ModelConfig c = *preset("tiny");  // 4 heads, 1 kv head, ffn 128
  EXPECT_NE(check_tensor_parallel(c, 3, "train")
                .message()
                .find("train: tp 3 does not divide "
                      "num_heads 4"),
            std::string::npos);
  EXPECT_NE(check_tensor_parallel(c, 0, "train").message().find("at least 1"), std::string::npos);
  ModelConfig odd = c;
  odd.ffn_dim = 130;
  EXPECT_NE(check_tensor_parallel(odd, 4, "x").message().find("does not divide ffn_dim 130"),
            std::string::npos);
  ModelConfig kv3 = c;
  kv3.num_heads = 12;
  kv3.num_kv_heads = 3;
  EXPECT_NE(check_tensor_parallel(kv3, 2, "x").message().find("num_kv_heads 3 is neither"),
            std::string::npos);
}

}  // namespace
}  // namespace wl::model
