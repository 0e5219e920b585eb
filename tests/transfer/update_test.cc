// Updates end to end, trainers and receivers as threads with their own UCX workers: after
// each update every receiver tensor equals the scalar reference bit for bit (TP 1 and 2,
// bf16 and fp8, meshes of 1 and 2, replicas, offloaded and bf16 shards); staging never passes
// the watermark; bad input and stale rkeys are refused before any byte is written; a byte
// corrupted in staging is caught by the checksums; readers never see two versions mixed.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>

#include "fixture.h"
#include "weightlift/core/random.h"
#include "weightlift/transfer/layout/layout_spec.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "weightlift/transfer/modes/update_executor.h"
#include "weightlift/transfer/plan/plan_transfer.h"

namespace wl::transfer {
namespace {

using testing::as_held;
using testing::Case;
using testing::expect_matches_reference;
using testing::guarded_update;
using testing::join;
using testing::named;
using testing::preset_or_die;
using testing::random_params;
using testing::random_weights;
using testing::Rank;
using testing::run_world;
using testing::slot_is_zero;

// Two updates (weights A, then B): each bit-exact; staging within a watermark set to the
// tightest this plan allows. The first with checksums (staged, then put or copied), the second
// without (prepared straight into a receiver's slot where the sender can map it).
void run_case(const Case& k) {
  SCOPED_TRACE(k.name());
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1), b = random_weights(c, 2);
  const std::vector<float> a_held = as_held(a, k.shard_dtype), b_held = as_held(b, k.shard_dtype);
  run_planned(k, a, [&](int, Rank& r, const Plan& plan) {
    if (r.weights) {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok()) << ex.status().to_string();
      const size_t wm = (*ex)->required_watermark();
      for (int v = 1; v <= 2; ++v) {
        if (v == 2) r.weights->assign_full(b);
        auto rep = guarded_update(**ex, r, {.watermark_bytes = wm, .checksums = v == 1});
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
        EXPECT_EQ(rep->version, uint64_t(v));
        EXPECT_LE(rep->peak_staging_bytes, wm);
        if (v == 1 && rep->tasks > 0 &&
            (k.shard_dtype == DType::kF32 || k.format == WeightFormat::kFP8)) {
          EXPECT_GT(rep->peak_staging_bytes, 0u);
        }
      }
    } else {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok()) << ex.status().to_string();
      for (int v = 1; v <= 2; ++v) {
        auto rep = guarded_update(**ex, r, {.checksums = v == 1});
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
        expect_matches_reference(*r.receiver, c, r.layout, v == 1 ? a_held : b_held, uint64_t(v));
      }
    }
  });
}

TEST(P2pUpdate, BitExactTp1And2Bf16AndFp8MeshOf1And2) {
  for (int tp : {1, 2}) {
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
      for (int mesh : {1, 2}) run_case({.mesh_size = mesh, .tp = tp, .format = f});
    }
  }
}

// Pipeline stages publish their own layers: every piece is read where its stage holds it.
TEST(P2pUpdate, BitExactFromPipelineStagesHoldingWholeLayers) {
  for (int tp : {1, 2}) {
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
      run_case({.mesh_size = 2, .tp = tp, .format = f, .stages = true});
    }
  }
  run_case({.meshes = 2, .mesh_size = 2, .format = WeightFormat::kFP8, .stages = true});
}

// q/k norms arrive whole on every rank, a dense layer's MLP split as an expert's.
TEST(P2pUpdate, BitExactQwen3MoeShapeTp1And2) {
  for (int tp : {1, 2}) {
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
      run_case({.preset = "tiny-qwen3-moe", .mesh_size = 2, .tp = tp, .format = f});
    }
  }
}

TEST(P2pUpdate, BitExactFromBf16AndOffloadedShards) {
  run_case({.mesh_size = 2,
            .tp = 2,
            .format = WeightFormat::kFP8,
            .shard_dtype = DType::kBF16,
            .offload = true});
  run_case({.mesh_size = 2, .tp = 2, .format = WeightFormat::kBF16, .shard_dtype = DType::kBF16});
  run_case({.mesh_size = 1, .tp = 1, .format = WeightFormat::kBF16, .offload = true});
}

TEST(P2pUpdate, BitExactFromReplicasToTwoEngines) {
  run_case({.meshes = 2, .mesh_size = 1, .tp = 1, .engines = 2, .format = WeightFormat::kFP8});
}

// Expert-parallel engines: each rank gets only its run of the experts (the reference picks
// them by its own rule, and a receiver holds nothing else), with TP and without, from a mesh
// and from replicas.
TEST(P2pUpdate, BitExactExpertParallelEngines) {
  run_case({.mesh_size = 2, .ep = 2, .format = WeightFormat::kBF16});
  run_case({.mesh_size = 2, .ep = 4, .format = WeightFormat::kFP8});
  run_case({.meshes = 2, .mesh_size = 1, .tp = 2, .ep = 2, .format = WeightFormat::kFP8});
  run_case({.preset = "tiny-qwen3-moe", .mesh_size = 2, .engines = 2, .ep = 2});
}

// The k/v bands of `small` on a mesh of 2 cross the shards (plan_test's
// Fp8SplitsOnlyBandsThatCrossShards): split, each half quantized with the whole band's scales.
TEST(P2pUpdate, BitExactSmallPresetWithWholeAndSplitBands) {
  run_case({.preset = "small", .mesh_size = 2, .tp = 2, .format = WeightFormat::kFP8});
}

TEST(P2pUpdate, WatermarkBelowThePlansNeedIsRefusedBeforeAnyPut) {
  const Case k{.mesh_size = 2, .tp = 2, .format = WeightFormat::kFP8};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
    Result<UpdateReport> rep = Status();
    if (r.weights) {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      const size_t wm = rank == 1 ? (*ex)->required_watermark() - 1 : size_t(1) << 30;
      rep = guarded_update(**ex, r, {.watermark_bytes = wm});
    } else {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      rep = guarded_update(**ex, r, {});
      EXPECT_TRUE(slot_is_zero(*r.receiver, 0) && slot_is_zero(*r.receiver, 1));
      EXPECT_EQ(r.receiver->version(), 0u);
    }
    ASSERT_FALSE(rep.ok());
    EXPECT_EQ(rep.status().code(), StatusCode::kResourceExhausted) << rep.status().to_string();
    if (rank == 1) {
      EXPECT_NE(rep.status().message().find("trainer rank 1: watermark"), std::string::npos)
          << rep.status().message();
    } else {
      EXPECT_NE(rep.status().message().find("refused by world rank 1"), std::string::npos)
          << rep.status().message();
    }
  });
}

TEST(P2pUpdate, BadLayoutIsRefusedOnEveryRankNamingTensorAndRank) {
  const Case k{.mesh_size = 1, .tp = 2, .format = WeightFormat::kBF16};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  run_world(k.size(), [&](int rank, std::shared_ptr<comm::Group> world) {
    Rank r = join(k, rank, world, a);
    if (rank == 2) r.meta.tensors[1].name = "layers.0.attn_nrom.weight";
    auto plan = plan_transfer(*world, r.meta);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
    EXPECT_NE(plan.status().message().find("receiver rank 2: tensor 'layers.0.attn_nrom.weight'"),
              std::string::npos)
        << plan.status().message();
    if (r.receiver) {
      EXPECT_TRUE(slot_is_zero(*r.receiver, 0) && slot_is_zero(*r.receiver, 1));
    }
  });
}

TEST(P2pUpdate, StaleRkeyOfARestartedReceiverIsRefusedBeforeAnyPut) {
  const Case k{.mesh_size = 1, .tp = 2, .format = WeightFormat::kFP8};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
    Result<UpdateReport> rep = Status();
    if (r.weights) {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      rep = guarded_update(**ex, r, {});
    } else {
      if (rank == 2) {  // restarts: new memory, new rkey, new epoch; keeps the old plan
        const ReceiverOptions opts = r.receiver->options();
        r.receiver.reset();
        auto again = Receiver::create(r.world->worker(), opts);
        ASSERT_TRUE(again.ok());
        r.receiver = std::move(*again);
      }
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      rep = guarded_update(**ex, r, {});
      EXPECT_TRUE(slot_is_zero(*r.receiver, 0) && slot_is_zero(*r.receiver, 1));
    }
    ASSERT_FALSE(rep.ok());
    EXPECT_EQ(rep.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(rep.status().message().find("receiver rank 2: stale rkey"), std::string::npos)
        << rep.status().message();
  });
}

// Flips one byte of the first task trainer 0 stages for receiver 2, after its checksum.
void corrupt_run(bool checksums, std::atomic<int>* corrupted) {
  const Case k{.mesh_size = 2, .tp = 2, .format = WeightFormat::kFP8};
  const model::ModelConfig c = preset_or_die(k.preset);
  const std::vector<float> a = random_weights(c, 1);
  run_planned(k, a, [&](int rank, Rank& r, const Plan& plan) {
    if (r.weights) {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      UpdateOptions o{.checksums = checksums};
      if (rank == 0) {
        o.staging_hook = [&](const PlanTask& t, std::span<std::byte> bytes) {
          if (t.receiver == 2 && corrupted->fetch_add(1) == 0)
            bytes[bytes.size() / 2] ^= std::byte{0x10};
        };
      }
      auto rep = guarded_update(**ex, r, o);
      EXPECT_EQ(rep.ok(), !checksums) << rep.status().to_string();
    } else {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      auto rep = guarded_update(**ex, r, {.checksums = checksums});
      if (checksums) {
        ASSERT_FALSE(rep.ok());
        EXPECT_EQ(rep.status().code(), StatusCode::kDataLoss);
        const std::string want = rank == 2 ? "receiver rank 2: tensor '" : "world rank 2 failed";
        EXPECT_NE(rep.status().message().find(want), std::string::npos) << rep.status().message();
        EXPECT_EQ(r.receiver->version(), 0u);  // the corrupted version was never published
      } else {
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
        // The hook really corrupts: without checksums receiver 2 now differs from the reference.
        const auto ref = reference_receiver_tensors(c, r.layout, a);
        Receiver::ReadGuard g = r.receiver->acquire();
        size_t differing = 0;
        for (const ReceiverEntry& e : r.receiver->entries()) {
          differing += std::memcmp(g.tensor(e.spec.name).raw(), ref.at(e.spec.name).bytes.data(),
                                   e.bytes) != 0;
        }
        EXPECT_EQ(differing, rank == 2 ? 1u : 0u);
      }
    }
  });
}

TEST(P2pUpdate, ChecksumsCatchACorruptedByte) {
  std::atomic<int> corrupted{0};
  corrupt_run(true, &corrupted);
  EXPECT_GE(corrupted.load(), 1);
  corrupted = 0;
  corrupt_run(false, &corrupted);
  EXPECT_GE(corrupted.load(), 1);
}

// Version v sets every weight to v, so every element of every receiver tensor is bf16(v) (0
// before the first update). A reader thread checks the first and last element of every tensor
// against its guard's version while six updates stream in.
TEST(P2pUpdate, ReadersNeverSeeTwoVersionsMixed) {
  const Case k{.mesh_size = 2, .tp = 1, .format = WeightFormat::kBF16};
  const model::ModelConfig c = preset_or_die(k.preset);
  const size_t n = size_t(model::ParamLayout(c).total());
  const std::vector<float> zero(n, 0.0f);
  std::atomic<int> torn{0}, reads{0};
  run_planned(k, zero, [&](int, Rank& r, const Plan& plan) {
    if (r.weights) {
      auto ex = make_executor(r, plan);
      ASSERT_TRUE(ex.ok());
      for (int v = 1; v <= 6; ++v) {
        r.weights->assign_full(std::vector<float>(n, float(v)));
        auto rep = guarded_update(**ex, r, {});
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
      }
      return;
    }
    auto ex = make_executor(r, plan);
    ASSERT_TRUE(ex.ok());
    std::atomic<bool> done{false};
    std::thread reader([&] {
      while (!done.load()) {
        Receiver::ReadGuard g = r.receiver->acquire();
        const uint16_t want = f32_to_bf16(float(g.version()));
        for (const ReceiverEntry& e : r.receiver->entries()) {
          const auto* p = static_cast<const uint16_t*>(g.tensor(e.spec.name).raw());
          if (p[0] != want || p[e.bytes / 2 - 1] != want) ++torn;
        }
        ++reads;
      }
    });
    for (int v = 1; v <= 6; ++v) {
      auto rep = guarded_update(**ex, r, {});
      ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    }
    done = true;
    reader.join();
    EXPECT_EQ(r.receiver->version(), 6u);
  });
  EXPECT_EQ(torn.load(), 0);
  EXPECT_GT(reads.load(), 0);
}

// A Llama with Hugging Face's names (layout_spec.h's built-in spec), not our model: trainers
// hold its parameters under those names (TrainerWeights::from_spec), receivers hold what the
// spec fuses (qkv_proj, gate_up_proj) at their TP rank. After each of two updates every
// receiver tensor equals the reference transform's, which picks heads and rows by itself.
void run_spec_case(int mesh_size, int tp, WeightFormat format) {
  SCOPED_TRACE("llama-hf, mesh of " + std::to_string(mesh_size) + ", tp " + std::to_string(tp) +
               " " + std::string(weight_format_name(format)));
  const model::ModelConfig c = preset_or_die("tiny");
  const LayoutSpec spec = llama_hf_layout_spec(c, WeightFormat::kFP8);
  const auto a = random_params(spec, 1), b = random_params(spec, 2);
  testing::run_world_keeping(mesh_size + tp, [&](int rank, std::shared_ptr<comm::Group> world) {
    auto r = std::make_shared<Rank>();
    r->world = world;
    const bool trainer = rank < mesh_size;
    auto mesh = world->split({.color = trainer ? 0 : comm::kNoColor, .key = rank});
    EXPECT_TRUE(mesh.ok()) << mesh.status().to_string();
    if (!mesh.ok()) return std::shared_ptr<void>(r);
    if (trainer) {
      const std::vector<NamedTensor> tensors = named(spec, a);
      EXPECT_TRUE(check_named_tensors(spec, tensors).ok());
      r->weights = std::make_unique<TrainerWeights>(
          TrainerWeights::from_spec(spec, tensors, *mesh, {.dtype = DType::kF32}));
      r->meta = describe_trainer(rank, *r->weights);
    } else {
      r->layout = {.tp = tp, .tp_rank = rank - mesh_size, .format = format};
      auto lay = spec_layout(spec_in_format(spec, format), tp, r->layout.tp_rank);
      EXPECT_TRUE(lay.ok()) << lay.status().to_string();
      if (!lay.ok()) return std::shared_ptr<void>(r);
      auto rc = Receiver::create(world->worker(), {.tensors = tensor_specs(*lay),
                                                   .tp = tp,
                                                   .tp_rank = r->layout.tp_rank,
                                                   .format = format});
      EXPECT_TRUE(rc.ok()) << rc.status().to_string();
      if (!rc.ok()) return std::shared_ptr<void>(r);
      r->receiver = std::move(*rc);
      r->meta = describe_receiver(rank, *r->receiver);
    }
    auto plan = plan_transfer(*world, r->meta);
    EXPECT_TRUE(plan.ok()) << plan.status().to_string();
    if (!plan.ok()) return std::shared_ptr<void>(r);
    auto ex = testing::make_executor(*r, *plan);
    EXPECT_TRUE(ex.ok()) << ex.status().to_string();
    if (!ex.ok()) return std::shared_ptr<void>(r);
    for (int v = 1; v <= 2; ++v) {
      if (trainer && v == 2) r->weights->assign_named(named(spec, b));
      auto rep = guarded_update(**ex, *r, {.checksums = true});
      EXPECT_TRUE(rep.ok()) << rep.status().to_string();
      if (!rep.ok() || trainer) continue;
      testing::expect_holds(*r->receiver,
                            reference_llama_hf_tensors(c, r->layout, v == 1 ? a : b, spec.params),
                            r->layout, uint64_t(v));
    }
    return std::shared_ptr<void>(r);
  });
}

TEST(P2pUpdate, AnyModelsLayoutSpecBitExactTp1And2Bf16AndFp8) {
  run_spec_case(1, 1, WeightFormat::kBF16);
  run_spec_case(2, 2, WeightFormat::kBF16);
  run_spec_case(2, 2, WeightFormat::kFP8);
}

// The naive and broadcast modes know our model's parameters only: a plan for another model's
// weights is refused by every rank, before anything moves.
TEST(P2pUpdate, OnlyP2pMovesALayoutSpecsModel) {
  const model::ModelConfig c = preset_or_die("tiny");
  const LayoutSpec spec = llama_hf_layout_spec(c, WeightFormat::kBF16);
  const auto a = random_params(spec, 1);
  run_world(2, [&](int rank, std::shared_ptr<comm::Group> world) {
    Rank r;
    r.world = world;
    auto mesh = world->split({.color = rank == 0 ? 0 : comm::kNoColor, .key = rank});
    ASSERT_TRUE(mesh.ok());
    if (rank == 0) {
      r.weights = std::make_unique<TrainerWeights>(
          TrainerWeights::from_spec(spec, named(spec, a), *mesh, {.dtype = DType::kF32}));
      r.meta = describe_trainer(rank, *r.weights);
    } else {
      auto lay = spec_layout(spec, 1, 0);
      ASSERT_TRUE(lay.ok());
      auto rc = Receiver::create(world->worker(), {.tensors = tensor_specs(*lay)});
      ASSERT_TRUE(rc.ok());
      r.receiver = std::move(*rc);
      r.meta = describe_receiver(rank, *r.receiver);
    }
    auto plan = plan_transfer(*world, r.meta);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    EXPECT_TRUE(plan->config_json.empty());
    for (TransferMode m : {TransferMode::kNaive, TransferMode::kBroadcast}) {
      auto ex = testing::make_executor(r, *plan, m);
      ASSERT_FALSE(ex.ok());
      EXPECT_NE(ex.status().message().find("moves weightlift's own model only"), std::string::npos)
          << ex.status().to_string();
    }
  });
}

}  // namespace
}  // namespace wl::transfer
