// The broadcast and naive modes end to end, trainers and receivers as threads with their own
// UCX workers: after each update every receiver tensor equals the scalar reference bit for
// bit, as in p2p (TP 1 and 2, bf16 and fp8, meshes of 1 and 2, replicas, f32 and bf16
// shards, one bucket or many); p2p's checksums are refused rather than ignored; the naive
// sender's watermark is checked before any byte moves.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "fixture.h"
#include "weightlift/transfer/modes/detail/update_round.h"
#include "weightlift/transfer/plan/plan_transfer.h"

namespace wl::transfer {
namespace {

using testing::as_held;
using testing::Case;
using testing::expect_matches_reference;
using testing::guarded_update;
using testing::join;
using testing::preset_or_die;
using testing::random_weights;
using testing::Rank;
using testing::run_world;
using testing::slot_is_zero;

std::unique_ptr<UpdateExecutor> executor_or_die(TransferMode mode, Rank& r, const Plan& plan,
                                                size_t bucket_bytes) {
  auto e = make_executor(r, plan, mode, bucket_bytes);
  WL_CHECK(e.ok()) << e.status().to_string();
  return std::move(*e);
}

// Two updates (weights A, then B), each bit-exact on every receiver.
void run_case(TransferMode mode, const Case& k, size_t bucket_bytes = size_t(64) << 20) {
  SCOPED_TRACE(std::string(mode == TransferMode::kBroadcast
                               ? "broadcast, bucket " + std::to_string(bucket_bytes)
                               : "naive") +
               ": " + k.name());
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  const std::vector<float> a_held = as_held(a, k.shard_dtype), b_held = as_held(b, k.shard_dtype);
  run_planned(k, a, [&](int, Rank& r, const Plan& plan) {
    std::unique_ptr<UpdateExecutor> ex = executor_or_die(mode, r, plan, bucket_bytes);
    for (int v = 1; v <= 2; ++v) {
      if (v == 2 && r.weights) r.weights->assign_full(b);
      auto rep = guarded_update(*ex, r, {.watermark_bytes = size_t(1) << 30});
      ASSERT_TRUE(rep.ok()) << rep.status().to_string();
      EXPECT_EQ(rep->version, uint64_t(v));
      EXPECT_LE(rep->peak_staging_bytes, rep->watermark_bytes);
      if (r.receiver) {
        EXPECT_GT(rep->bytes, 0u);
        expect_matches_reference(*r.receiver, c, r.layout, v == 1 ? a_held : b_held, uint64_t(v));
      }
    }
  });
}

TEST(BroadcastMode, BitExactTp1And2Bf16AndFp8MeshOf1And2) {
  for (int tp : {1, 2}) {
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
      for (int mesh : {1, 2})
        run_case(TransferMode::kBroadcast, {.mesh_size = mesh, .tp = tp, .format = f});
    }
  }
}

TEST(BroadcastMode, BitExactWithOneGroupPerBucketBf16ShardsAndReplicas) {
  // Bucket size 1 is raised to the largest parameter group: one group per bucket, owners
  // alternating between the two mesh ranks.
  run_case(TransferMode::kBroadcast,
           {.mesh_size = 2, .tp = 2, .format = WeightFormat::kFP8, .shard_dtype = DType::kBF16}, 1);
  run_case(TransferMode::kBroadcast,
           {.meshes = 2, .mesh_size = 1, .tp = 1, .engines = 2, .format = WeightFormat::kFP8},
           40000);
}

// Whole layers on each stage: the owners' full_tensor() gathers by the stages' splits.
TEST(Modes, BroadcastAndNaiveFromPipelineStagesHoldingWholeLayers) {
  for (TransferMode mode : {TransferMode::kBroadcast, TransferMode::kNaive}) {
    run_case(mode, {.mesh_size = 2, .tp = 2, .format = WeightFormat::kFP8, .stages = true}, 1);
  }
}

TEST(NaiveMode, BitExactTp1And2Bf16AndFp8MeshOf1And2) {
  for (int tp : {1, 2}) {
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
      for (int mesh : {1, 2})
        run_case(TransferMode::kNaive, {.mesh_size = mesh, .tp = tp, .format = f});
    }
  }
  run_case(TransferMode::kNaive, {.meshes = 2,
                                  .mesh_size = 1,
                                  .tp = 2,
                                  .format = WeightFormat::kFP8,
                                  .shard_dtype = DType::kBF16});
}

// Checksums belong to p2p's tasks; asking for them elsewhere is an error on every rank, and
// a naive sender whose watermark cannot hold the state dict twice refuses, before any byte.
TEST(Modes, RefuseChecksumsAndASmallNaiveWatermarkBeforeAnyByte) {
  const Case k{.mesh_size = 1, .tp = 2, .format = WeightFormat::kBF16};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  for (TransferMode mode : {TransferMode::kBroadcast, TransferMode::kNaive}) {
    run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
      std::unique_ptr<UpdateExecutor> ex = executor_or_die(mode, r, plan, size_t(1) << 20);
      auto rep = guarded_update(*ex, r, {.watermark_bytes = size_t(1) << 30, .checksums = true});
      ASSERT_FALSE(rep.ok());
      EXPECT_EQ(rep.status().code(), StatusCode::kInvalidArgument) << rep.status().to_string();
      // Every rank refuses; each reports the lowest refusing rank, rank 0 its own reason.
      const std::string why = rank == 0 ? "no per-task checksums" : "refused by world rank 0";
      EXPECT_NE(rep.status().message().find(why), std::string::npos) << rep.status().message();
      if (mode == TransferMode::kNaive) {
        rep = guarded_update(
            *ex, r, {.watermark_bytes = size_t(1) << 20});  // tiny in f32: 1.04 MB, needed twice
        ASSERT_FALSE(rep.ok());
        EXPECT_EQ(rep.status().code(), StatusCode::kResourceExhausted) << rep.status().to_string();
        const std::string want =
            rank == 0 ? "trainer rank 0: watermark" : "refused by world rank 0";
        EXPECT_NE(rep.status().message().find(want), std::string::npos) << rep.status().message();
      }
      if (r.receiver) {
        EXPECT_TRUE(slot_is_zero(*r.receiver, 0) && slot_is_zero(*r.receiver, 1));
        EXPECT_EQ(r.receiver->version(), 0u);
      }
    });
  }
}

// A plan that puts a trainer elsewhere in its mesh, or leaves a receiver out, is refused by
// every mode's executor when it is made, naming the rank and both positions.
TEST(Modes, AnExecutorRefusesAPlanThatMisplacesItsRank) {
  const Case k{.mesh_size = 1, .tp = 2, .format = WeightFormat::kBF16};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
    Plan wrong = plan;
    wrong.mesh_size = 2;
    wrong.receivers.clear();
    std::vector<Status> refusals;
    for (TransferMode mode : {TransferMode::kP2P, TransferMode::kBroadcast, TransferMode::kNaive}) {
      refusals.push_back(make_executor(r, wrong, mode).status());
    }
    const std::string want =
        r.weights
            ? "trainer rank " + std::to_string(rank) + ": the plan puts it at mesh " +
                  std::to_string(rank) + " rank 0 of 2, its weights are at mesh " +
                  std::to_string(rank) + " rank 0 of 1"
            : "receiver rank " + std::to_string(rank) + ": not a receiver of this transfer plan";
    for (const Status& s : refusals) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find(want), std::string::npos) << s.message();
    }
  });
}

// A plan made for trainers that hold other rows (here: every task sent by stage 0, whose
// weights hold only the first layer and the embedding) is refused by the sender it
// misplaces, naming the rows, before an executor starts.
TEST(Modes, ATrainerRefusesAPlanThatSendsRowsItDoesNotHold) {
  const Case k{.mesh_size = 2, .tp = 2, .format = WeightFormat::kBF16, .stages = true};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
    if (!r.weights) return;
    Plan wrong = plan;
    for (PlanTask& t : wrong.tasks) t.sender = 0;
    const auto placed = place_trainer(wrong, rank, *r.weights);
    if (rank == 1) {
      EXPECT_TRUE(placed.ok()) << placed.status().to_string();  // sends nothing now
      return;
    }
    ASSERT_FALSE(placed.ok());
    EXPECT_EQ(placed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(placed.status().message().find("which its weights do not hold"), std::string::npos)
        << placed.status().message();
    EXPECT_NE(placed.status().message().find("layers.1."), std::string::npos)
        << placed.status().message();
    EXPECT_TRUE(place_trainer(plan, rank, *r.weights).ok());
  });
}

}  // namespace
}  // namespace wl::transfer
