// RowShards on every layout's ownership: each rank's shards are exactly its rows of the whole
// model by the splits it reports, read where the layout keeps them (DDP, FSDP, a pipeline
// stage's layers, an expert group's experts: in place, nothing sent) or moved from tensor
// bands of columns (an all-to-all).
#include "weightlift/parallel/run/row_shards.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <numeric>

#include "train_ranks.h"
#include "weightlift/core/dtype.h"

namespace wl::parallel {
namespace {

using testing::model_config;
using testing::run_data_parallel;

struct ShardsCase {
  const char* name;
  const char* model;
  int ranks;
  ParallelLayout layout;
  bool in_place;
};

void PrintTo(const ShardsCase& c, std::ostream* os) { *os << c.name; }

class RowShardsTest : public ::testing::TestWithParam<ShardsCase> {};

TEST_P(RowShardsTest, EveryRankGetsItsShardOfTheWholeModel) {
  const ShardsCase& k = GetParam();
  const model::ModelConfig c = model_config(k.model);
  const model::ParamLayout layout(c);
  // Every element distinct, so a row or column out of place cannot go unseen.
  std::vector<float> whole(size_t(layout.total()));
  std::iota(whole.begin(), whole.end(), 0.0f);
  // The weights of a second round, as after an optimizer step: every element changed.
  std::vector<float> stepped(whole.size());
  std::transform(whole.begin(), whole.end(), stepped.begin(), [](float x) { return -x - 1; });
  std::mutex mu;
  std::vector<int64_t> covered(size_t(k.ranks), 0);
  run_data_parallel(
      k.ranks, c, k.layout, [&](DataParallel& dp, const std::shared_ptr<comm::Group>& world) {
        dp.set_params(whole.data());
        auto shards = RowShards::create(dp, world, std::chrono::seconds(30));
        ASSERT_TRUE(shards.ok()) << shards.status().to_string();
        const int rank = world ? world->rank() : 0;
        EXPECT_EQ((*shards)->in_place(), k.in_place) << "rank " << rank;
        if (k.in_place) {
          EXPECT_EQ((*shards)->sent_elems(), 0);
        }
        // Twice: the second refresh reuses the plan and its buffers, and reads the weights
        // as they are then.
        for (int round = 0; round < 2; ++round) {
          const std::vector<float>& now = round == 0 ? whole : stepped;
          if (round == 1) dp.set_params(stepped.data());
          auto got = (*shards)->refresh();
          ASSERT_TRUE(got.ok()) << got.status().to_string();
          int64_t elems = 0;
          for (const RowShards::Shard& s : *got) {
            const model::ParamInfo& p = layout.params()[s.param];
            const int64_t width = p.numel() / p.shape[0];
            const ShardRows want = (*shards)->splits()[s.param].rank_rows(rank);
            ASSERT_EQ(s.rows.begin, want.begin) << p.name << " rank " << rank;
            ASSERT_EQ(s.rows.end, want.end) << p.name << " rank " << rank;
            const float* expect = now.data() + p.offset + want.begin * width;
            for (int64_t e = 0; e < want.size() * width; ++e) {
              ASSERT_EQ(s.data[e], expect[e]) << p.name << " rank " << rank << " element " << e;
            }
            elems += want.size() * width;
          }
          EXPECT_EQ(elems, (*shards)->shard_elems());
          // Packed and placed back (how rank 0 rebuilds the whole policy), its rows land where
          // they are in the whole model, and nothing else is written.
          auto packed = (*shards)->refresh_packed();
          ASSERT_TRUE(packed.ok()) << packed.status().to_string();
          EXPECT_EQ(int64_t(packed->size()), (*shards)->shard_elems(rank));
          std::vector<float> placed(now.size(), 0.5f);
          (*shards)->place(rank, packed->data(), placed.data());
          int64_t written = 0;
          for (size_t e = 0; e < now.size(); ++e) {
            if (placed[e] == 0.5f) continue;
            ASSERT_EQ(placed[e], now[e]) << "rank " << rank << " element " << e;
            ++written;
          }
          EXPECT_EQ(written, elems);
          std::lock_guard<std::mutex> lock(mu);
          covered[size_t(rank)] = elems;
        }
      });
  EXPECT_EQ(std::accumulate(covered.begin(), covered.end(), int64_t(0)), layout.total());
}

// The servers' bf16 copy written by the optimizer (DataParallel::mirror_bf16, as the RL trainer
// installs it): where a rank's shards are in place, a mirror of them is accepted, and after an
// optimizer step holds every element of the shards as they are then, rounded to bf16 (the
// buffer starts as a pattern no rounding gives, so an element not written is seen). Another
// write of the weights makes it stale. Where the shards are moved from other ranks (TP bands)
// they are not this rank's weights, and a range outside the weights is refused.
TEST_P(RowShardsTest, TheOptimizerKeepsAMirrorOfInPlaceShards) {
  const ShardsCase& k = GetParam();
  const model::ModelConfig c = model_config(k.model);
  const model::ParamLayout layout(c);
  std::vector<float> whole(size_t(layout.total()));
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = 0.01f * float(i % 997) - 5.0f;
  run_data_parallel(
      k.ranks, c, k.layout, [&](DataParallel& dp, const std::shared_ptr<comm::Group>& world) {
        dp.set_params(whole.data());
        auto shards = RowShards::create(dp, world, std::chrono::seconds(30));
        ASSERT_TRUE(shards.ok()) << shards.status().to_string();
        const int rank = world ? world->rank() : 0;
        auto got = (*shards)->refresh();
        ASSERT_TRUE(got.ok()) << got.status().to_string();
        std::vector<std::vector<uint16_t>> copies;
        // The readers are told before the first write and after the last.
        auto untouched = [&] {
          for (const std::vector<uint16_t>& copy : copies) {
            for (uint16_t x : copy) {
              if (x != 0xffff) return false;
            }
          }
          return true;
        };
        Bf16Mirrors mirrors;
        int before = 0, after = 0;
        mirrors.before_write = [&] {
          if (++before == 1) {
            EXPECT_TRUE(untouched()) << "rank " << rank;
          }
        };
        mirrors.after_write = [&] {
          ++after;
          EXPECT_FALSE(untouched()) << "rank " << rank;
        };
        for (const RowShards::Shard& sh : *got) {
          const model::ParamInfo& p = layout.params()[sh.param];
          const int64_t n = sh.rows.size() * (p.numel() / p.shape[0]);
          copies.emplace_back(size_t(n), uint16_t(0xffff));  // a NaN rounding never gives
          mirrors.ranges.push_back({sh.data, n, copies.back().data()});
        }
        std::vector<float> outside(16);
        std::vector<uint16_t> outside_copy(16);
        EXPECT_FALSE(dp.mirror_bf16({.ranges = {{outside.data(), 16, outside_copy.data()}}}));
        const bool accepted = dp.mirror_bf16(mirrors);
        EXPECT_EQ(accepted, k.in_place) << "rank " << rank;
        if (!accepted) return;
        EXPECT_FALSE(dp.mirrors_current());
        // A skipped step (non-finite gradients) writes nothing and tells no reader.
        auto skipped = dp.apply_optimizer(1e-2, std::nan(""));
        ASSERT_TRUE(skipped.ok()) << skipped.status().to_string();
        EXPECT_TRUE(skipped->skipped);
        EXPECT_EQ(before + after, 0);
        EXPECT_TRUE(untouched());
        EXPECT_FALSE(dp.mirrors_current());
        // A step with no gradient still moves every matrix by its weight decay.
        auto stepped = dp.apply_optimizer(1e-2, 1.0);
        ASSERT_TRUE(stepped.ok()) << stepped.status().to_string();
        EXPECT_EQ(before, 1);
        EXPECT_EQ(after, 1);
        EXPECT_TRUE(dp.mirrors_current());
        auto now = (*shards)->refresh();
        ASSERT_TRUE(now.ok()) << now.status().to_string();
        ASSERT_EQ(now->size(), copies.size());
        for (size_t i = 0; i < copies.size(); ++i) {
          const RowShards::Shard& sh = (*now)[i];
          for (size_t e = 0; e < copies[i].size(); ++e) {
            ASSERT_EQ(copies[i][e], f32_to_bf16(sh.data[e]))
                << layout.params()[sh.param].name << " rank " << rank << " element " << e;
          }
        }
        // Any other write of the weights leaves the mirror behind.
        dp.set_params(whole.data());
        EXPECT_FALSE(dp.mirrors_current());
        ASSERT_TRUE(dp.apply_optimizer(1e-2, 1.0).ok());
        EXPECT_TRUE(dp.mirrors_current());
        (void)dp.rows_to_load();
        EXPECT_FALSE(dp.mirrors_current());
        // An empty set stops mirroring: a step leaves the copies as they were.
        ASSERT_TRUE(dp.mirror_bf16({}));
        for (std::vector<uint16_t>& copy : copies) std::fill(copy.begin(), copy.end(), 0xffff);
        ASSERT_TRUE(dp.apply_optimizer(1e-2, 1.0).ok());
        EXPECT_TRUE(untouched());
        EXPECT_EQ(before, 2);
      });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RowShardsTest,
    ::testing::Values(ShardsCase{"one", "tiny", 1, {}, true},
                      ShardsCase{"ddp", "tiny", 2, {}, true},
                      ShardsCase{"fsdp", "tiny", 2, {.dp_mode = DpMode::kFsdp}, true},
                      ShardsCase{"zero1", "tiny", 2, {.dp_mode = DpMode::kZero1}, true},
                      ShardsCase{"zero2", "tiny", 2, {.dp_mode = DpMode::kZero2}, true},
                      ShardsCase{"tp", "tiny_gqa", 2, {.tp = 2}, false},
                      ShardsCase{"ep", "tiny", 2, {.ep = 2}, true},
                      ShardsCase{"ep_fsdp", "tiny", 4, {.dp_mode = DpMode::kFsdp, .ep = 2}, true},
                      ShardsCase{"pp", "tiny", 2, {.pp = 2}, true},
                      ShardsCase{"pp_tied", "tiny_tied", 2, {.pp = 2}, true},
                      ShardsCase{
                          "tp_zero1", "tiny", 4, {.dp_mode = DpMode::kZero1, .tp = 2}, false},
                      ShardsCase{"pp_tp", "qwen4", 4, {.pp = 2, .tp = 2}, false},
                      ShardsCase{"tp_ep", "tiny", 4, {.tp = 2, .ep = 2}, false}),
    [](const ::testing::TestParamInfo<ShardsCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace wl::parallel
