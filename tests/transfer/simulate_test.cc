// The cluster-scale simulation: Kimi-K2's parameter count against a closed form; the schedule
// against the real planner where both apply (same tasks, gathers and bytes per rank); every
// receiver byte covered exactly once at a reduced K2 scale; the network model against closed
// forms on one or two senders; the sensitivity table's directions; bad options refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "fixture.h"
#include "small_cluster.h"
#include "weightlift/transfer/plan/planner.h"
#include "weightlift/transfer/sim/cluster.h"
#include "weightlift/transfer/sim/kimi_k2.h"
#include "weightlift/transfer/sim/load_schedule.h"
#include "weightlift/transfer/sim/network_model.h"

namespace wl::transfer {
namespace {

using testing::preset_or_die;

using testing::small_cluster;
using testing::small_k2;

TEST(KimiK2, ParameterCountMatchesTheClosedForm) {
  const K2Shapes s;  // the public config
  const int64_t d = s.hidden, H = s.num_heads;
  const int64_t attn = s.q_lora * d + s.q_lora + H * (s.qk_nope + s.qk_rope) * s.q_lora +
                       (s.kv_lora + s.qk_rope) * d + s.kv_lora +
                       H * (s.qk_nope + s.v_head) * s.kv_lora + d * H * s.v_head;
  const int64_t moe = s.num_experts * d + (s.num_experts + s.num_shared) * 3 * s.moe_ffn * d;
  const int64_t want = 2 * s.vocab * d + d + s.num_layers * (attn + 2 * d) +
                       s.first_dense * 3 * s.dense_ffn * d + (s.num_layers - s.first_dense) * moe;
  EXPECT_EQ(k2_param_count(s), want);
  EXPECT_EQ(k2_param_count(s), 1026408209408);  // "about 1.04T" in Moonshot's words
  std::printf("Kimi-K2 parameters from its public shapes: %lld\n", (long long)k2_param_count(s));
}

TEST(KimiK2, LayoutRefusesInstancesTheModelCannotBeSplitBy) {
  auto bad = k2_inference_layout(K2Shapes{}, {.engine_gpus = 3, .rank = 0});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("num_attention_heads"), std::string::npos);
  EXPECT_FALSE(k2_inference_layout(K2Shapes{}, {.engine_gpus = 16, .rank = 16}).ok());
}

// The schedule with every parameter on one placement of all meshes is plan/planner.cc's input:
// both must give the same tasks, split bands, maxima rounds and bytes per rank.
TEST(ScheduleLoads, AgreesWithThePlanner) {
  struct Case {
    const char* preset;
    int meshes, mesh_size, tp, engines;
    WeightFormat format;
  };
  for (const Case& c :
       {Case{"tiny", 1, 2, 2, 1, WeightFormat::kBF16}, Case{"tiny", 2, 3, 2, 2, WeightFormat::kFP8},
        Case{"tiny", 2, 2, 4, 1, WeightFormat::kFP8}, Case{"small", 3, 2, 2, 2, WeightFormat::kFP8},
        Case{"small", 1, 4, 1, 3, WeightFormat::kBF16}}) {
    SCOPED_TRACE(std::string(c.preset) + " " + std::to_string(c.meshes) + "x" +
                 std::to_string(c.mesh_size) + " tp " + std::to_string(c.tp) + " x" +
                 std::to_string(c.engines));
    const model::ModelConfig config = preset_or_die(c.preset);
    const int trainers = c.meshes * c.mesh_size, receivers = c.tp * c.engines;
    std::vector<RankMeta> metas;
    for (int i = 0; i < trainers; ++i) {
      metas.push_back(paper_trainer(config, i, i / c.mesh_size, i % c.mesh_size, c.mesh_size));
    }
    for (int r = 0; r < receivers; ++r) {
      auto m = paper_receiver(config, trainers + r,
                              {.tp = c.tp, .tp_rank = r % c.tp, .format = c.format}, r / c.tp);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      metas.push_back(*std::move(m));
    }
    auto plan = make_plan(metas);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();

    ClusterOptions o{.model = c.preset,
                     .trainers = trainers,
                     .receivers = receivers,
                     .gpus_per_node = 1,
                     .engine_gpus = c.tp,
                     .dense_mesh = c.mesh_size,
                     .expert_mesh = 0,
                     .format = c.format,
                     .shard_dtype = DType::kF32};
    auto in = cluster_schedule_input(o);
    ASSERT_TRUE(in.ok()) << in.status().to_string();
    auto loads = schedule_loads(*in);
    ASSERT_TRUE(loads.ok()) << loads.status().to_string();
    const PhaseLoads& dense = loads->phase[0];
    const PhaseLoads& expert = loads->phase[1];
    EXPECT_EQ(dense.tasks + expert.tasks, plan->tasks.size());
    uint64_t split_bands = 0;  // one sub-band of each carries its scale row
    for (const PlanTask& t : plan->tasks) split_bands += t.maxima >= 0 && t.scale_bytes > 0;
    EXPECT_EQ(dense.split_bands + expert.split_bands, split_bands);
    if (c.format == WeightFormat::kFP8 && c.mesh_size > 1) {
      EXPECT_GT(split_bands, 0u);
    }
    const std::vector<uint64_t> bytes = plan_bytes_by_rank(*plan);
    for (int t = 0; t < trainers; ++t) {
      EXPECT_EQ(dense.sent[size_t(t)] + expert.sent[size_t(t)], bytes[size_t(t)])
          << "trainer " << t;
      const int mesh = t / c.mesh_size;
      EXPECT_EQ(dense.maxima_rounds[size_t(t)] + expert.maxima_rounds[size_t(t)],
                plan->maxima_floats[size_t(mesh)] > 0 ? 1u : 0u)
          << "trainer " << t;
    }
    for (int r = 0; r < receivers; ++r) {
      EXPECT_EQ(dense.received[size_t(r)] + expert.received[size_t(r)], bytes[size_t(trainers + r)])
          << "receiver " << r;
    }
  }
}

// At a reduced Kimi-K2 scale with its real layouts (HSDP dense, EP experts, TP+EP receivers),
// the tasks cover every receiver tensor's rows exactly once and every byte of it.
TEST(ScheduleLoads, CoversEveryReceiverByteOnceAtReducedK2Scale) {
  for (WeightFormat format : {WeightFormat::kFP8, WeightFormat::kBF16}) {
    SCOPED_TRACE(weight_format_name(format));
    ClusterOptions o = small_cluster();
    o.format = format;
    auto in = cluster_schedule_input(o);
    ASSERT_TRUE(in.ok()) << in.status().to_string();
    std::map<std::pair<int, const ReceiverTensor*>, std::vector<std::pair<int64_t, int64_t>>> rows;
    std::map<std::pair<int, const ReceiverTensor*>, uint64_t> bytes, scale_bytes;
    in->on_task = [&](const ScheduleTask& t) {
      rows[{t.receiver, t.tensor}].push_back({t.row_begin, t.row_end});
      bytes[{t.receiver, t.tensor}] += t.bytes;
      scale_bytes[{t.receiver, t.tensor}] += t.scale_bytes;
      EXPECT_FALSE(t.tensor->expert && t.split)
          << t.tensor->name << ": an expert band should lie inside one shard";
    };
    auto loads = schedule_loads(*in);
    ASSERT_TRUE(loads.ok()) << loads.status().to_string();
    EXPECT_EQ(loads->phase[1].split_bands, 0u);
    for (int r = 0; r < o.receivers; ++r) {
      uint64_t want = 0;
      const auto& lay = in->layouts[size_t(in->receiver_layout[size_t(r)])];
      std::map<std::string, const ReceiverTensor*> by_name;
      for (const ReceiverTensor& t : lay) by_name[t.name] = &t;
      for (const ReceiverTensor& t : lay) {
        want += t.nbytes();
        if (t.sources.empty()) continue;
        auto got = rows[{r, &t}];
        std::sort(got.begin(), got.end());
        int64_t at = 0;
        for (auto [b, e] : got) {
          EXPECT_EQ(b, at) << t.name << " of receiver " << r << ": gap or overlap";
          at = e;
        }
        EXPECT_EQ(at, t.rows) << t.name << " of receiver " << r;
        EXPECT_EQ((bytes[{r, &t}]), t.nbytes()) << t.name;
        EXPECT_EQ((scale_bytes[{r, &t}]), t.quantized() ? by_name.at(t.scale)->nbytes() : 0u)
            << t.name;
      }
      EXPECT_EQ(loads->phase[0].received[size_t(r)] + loads->phase[1].received[size_t(r)], want)
          << "receiver " << r;
    }
  }
}

// Seed 000's scale: Kimi-K2, 256 trainers, 128 receivers in 8 engines of 16, fp8. About 18
// million tasks, scheduled in about a second on one core; every receiver gets exactly the
// bytes its layout holds, and no expert band needs a gather (EP shards align with the bands).
TEST(ScheduleLoads, KimiK2AtFullScale) {
  const ClusterOptions o;
  auto in = cluster_schedule_input(o);
  ASSERT_TRUE(in.ok()) << in.status().to_string();
  std::vector<uint64_t> want;
  for (const auto& lay : in->layouts) {
    uint64_t b = 0;
    for (const ReceiverTensor& t : lay) b += t.nbytes();
    want.push_back(b);
  }
  auto loads = schedule_loads(*in);
  ASSERT_TRUE(loads.ok()) << loads.status().to_string();
  for (int r = 0; r < o.receivers; ++r) {
    EXPECT_EQ(loads->phase[0].received[size_t(r)] + loads->phase[1].received[size_t(r)],
              want[size_t(in->receiver_layout[size_t(r)])])
        << "receiver " << r;
  }
  EXPECT_EQ(loads->phase[1].split_bands, 0u);
  EXPECT_GT(loads->phase[0].tasks + loads->phase[1].tasks, 10'000'000u);
}

// One parameter [rows, cols] on `trainers` trainers (one mesh), one receiver holding it whole.
ScheduleInput one_tensor(int64_t rows, int64_t cols, int trainers, WeightFormat format) {
  ScheduleInput in{.trainers = trainers};
  Placement pl;
  for (int t = 0; t < trainers; ++t) {
    if (pl.meshes.empty()) pl.meshes.emplace_back();
    pl.meshes[0].push_back(t);
  }
  in.placements.push_back(pl);
  in.params.push_back({"w", rows, cols, 0});
  const bool fp8 = format == WeightFormat::kFP8;
  ReceiverTensor t{.name = "w",
                   .dtype = fp8 ? DType::kF8E4M3 : DType::kBF16,
                   .shape = {rows, cols},
                   .rows = rows,
                   .cols = cols,
                   .sources = {{"w", 0, rows, 0, cols, 0}}};
  std::vector<ReceiverTensor> lay;
  if (fp8) {
    t.scale = "w.scale";
    const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
    lay.push_back(t);
    lay.push_back({.name = "w.scale",
                   .dtype = DType::kF32,
                   .shape = {br, bc},
                   .rows = br,
                   .cols = bc,
                   .scale_of = "w"});
  } else {
    lay.push_back(t);
  }
  in.layouts.push_back(lay);
  in.receiver_layout = {0};
  return in;
}

TEST(NetworkModel, OneSenderOneReceiverIsBytesOverBandwidthPlusOverheads) {
  const ScheduleInput in = one_tensor(1000, 500, 1, WeightFormat::kBF16);
  auto loads = schedule_loads(in);
  ASSERT_TRUE(loads.ok());
  const double bytes = 1000 * 500 * 2, nic = 400e9 / 8, o = 3e-6;
  for (bool overlap : {false, true}) {
    const NetworkModel m{
        .nic_gbps = 400, .message_overhead_us = 3, .barrier_ms = 0, .overlap = overlap};
    const Prediction p = predict(*loads, m);
    EXPECT_NEAR(p.seconds, bytes / nic + o, 1e-15) << "overlap " << overlap;
    EXPECT_EQ(p.total_messages, 1u);
    EXPECT_EQ(p.critical_sender, 0);
    EXPECT_EQ(p.critical_receiver, 0);
  }
  // A barrier longer than the transfer: overlapped, the group lasts the barrier; in series,
  // both.
  NetworkModel m{.nic_gbps = 400, .message_overhead_us = 3, .barrier_ms = 5};
  EXPECT_NEAR(predict(*loads, m).seconds, 5e-3, 1e-15);
  m.overlap = false;
  EXPECT_NEAR(predict(*loads, m).seconds, 5e-3 + bytes / nic + o, 1e-15);
}

TEST(NetworkModel, OneFp8BandIsPrepareThenTwoPuts) {
  // 128 x 256: one band, 2 scale blocks; the trainer reads 128*256 bf16 to quantize it.
  const ScheduleInput in = one_tensor(128, 256, 1, WeightFormat::kFP8);
  auto loads = schedule_loads(in);
  ASSERT_TRUE(loads.ok());
  const double bytes = 128 * 256 + 2 * 4, nic = 100e9 / 8, o = 2e-6;
  const double prepare = 128.0 * 256 * 2 / 10e9;
  for (bool overlap : {false, true}) {
    const NetworkModel m{.nic_gbps = 100,
                         .message_overhead_us = 2,
                         .prepare_gbs = 10,
                         .barrier_ms = 0,
                         .overlap = overlap};
    // One task goes through both stages whether or not they overlap.
    EXPECT_NEAR(predict(*loads, m).seconds, prepare + bytes / nic + 2 * o, 1e-15);
  }
}

TEST(NetworkModel, TwoSendersIntoOneReceiverAreReceiverBound) {
  // Two trainers each hold 500 of the 1000 rows and send them straight from their shards.
  const ScheduleInput in = one_tensor(1000, 500, 2, WeightFormat::kBF16);
  auto loads = schedule_loads(in);
  ASSERT_TRUE(loads.ok());
  EXPECT_EQ(loads->phase[0].sent, (std::vector<uint64_t>{500000, 500000}));
  EXPECT_EQ(loads->phase[0].split_bands, 0u);
  const NetworkModel m{.nic_gbps = 400, .message_overhead_us = 1, .barrier_ms = 0};
  const Prediction p = predict(*loads, m);
  EXPECT_NEAR(p.seconds, 1e6 / 50e9, 1e-15);
  EXPECT_EQ(p.groups.at(0).bound, "receiver NIC in");
}

TEST(NetworkModel, RanksSharingANicShareItsBandwidth) {
  // Two trainers send their 500 rows to each of two receivers: 1 MB through every rank's NIC.
  ScheduleInput in = one_tensor(1000, 500, 2, WeightFormat::kBF16);
  in.receiver_layout = {0, 0};
  auto loads = schedule_loads(in);
  ASSERT_TRUE(loads.ok());
  NetworkModel m{.nic_gbps = 400, .message_overhead_us = 0, .barrier_ms = 0};
  EXPECT_NEAR(predict(*loads, m).seconds, 1e6 / 50e9, 1e-15);
  // Both trainers on one NIC and both receivers on another, as two ranks of a testbed host
  // each: every NIC carries 2 MB.
  m.gpus_per_nic = 2;
  const Prediction shared = predict(*loads, m);
  EXPECT_NEAR(shared.seconds, 2e6 / 50e9, 1e-15);
  EXPECT_NEAR(shared.critical_receiver_seconds, 2e6 / 50e9, 1e-15);
  for (const Term& t : shared.groups.at(0).terms) {
    if (t.name == "receiver NIC in" || t.name == "sender NIC out") {
      EXPECT_NEAR(t.seconds, 2e6 / 50e9, 1e-15) << t.name;
    }
  }
}

TEST(NetworkModel, SensitivityMovesTheRightWay) {
  ClusterOptions o = small_cluster();
  auto in = cluster_schedule_input(o);
  ASSERT_TRUE(in.ok());
  auto loads = schedule_loads(*in);
  ASSERT_TRUE(loads.ok());
  const double base = predict(*loads, o.network).seconds;
  for (const Sensitivity& s : network_sensitivity(*loads, o.network)) {
    SCOPED_TRACE(s.name);
    const bool cost =
        s.name == "message_overhead_us" || s.name == "barrier_ms" || s.name == "maxima_ms";
    // More bandwidth never slows an update; more overhead never speeds it up.
    EXPECT_GE(cost ? s.twice_seconds : s.half_seconds, base);
    EXPECT_LE(cost ? s.half_seconds : s.twice_seconds, base);
  }
  // Two senders into one receiver, 32 MB in two puts: the receiver's NIC bounds it, so NIC
  // bandwidth is what moves it most (in the small K2 above, tensors are so small that put
  // overheads and the barrier matter as much).
  auto big = schedule_loads(one_tensor(4096, 4096, 2, WeightFormat::kBF16));
  ASSERT_TRUE(big.ok());
  const NetworkModel m{.barrier_ms = 0};
  const std::vector<Sensitivity> rows = network_sensitivity(*big, m);
  EXPECT_EQ(rows.at(size_t(dominant_assumption(rows, predict(*big, m).seconds))).name, "nic_gbps");
}

// A band that straddles two shards is split between them: each mesh rank sends its rows, one
// of them the scale row, and the mesh's one maxima round (maxima_ms, on every rank of the
// mesh) adds to the sender's NIC out time (the thread that waits for it posts no put
// meanwhile); 0 leaves the model as it was. No parameter byte moves between the trainers.
TEST(NetworkModel, ABandSplitAcrossShardsCostsOneMaximaRound) {
  ScheduleInput in = one_tensor(1000, 512, 2, WeightFormat::kFP8);
  std::vector<ScheduleTask> tasks;
  in.on_task = [&](const ScheduleTask& t) { tasks.push_back(t); };
  auto loads = schedule_loads(in);
  ASSERT_TRUE(loads.ok());
  const PhaseLoads& p = loads->phase[0];
  ASSERT_EQ(p.split_bands, 1u) << "rows 384-511 straddle the shards' boundary at 500";
  EXPECT_EQ(p.maxima_rounds, (std::vector<uint64_t>{1, 1}));
  EXPECT_EQ(p.maxima_bytes, (std::vector<uint64_t>{16, 16}));  // 4 blocks of 128 columns
  // Each rank reads its own rows of the band for their maxima: 116 and 12 rows of bf16.
  EXPECT_EQ(p.maxima_prepare, (std::vector<uint64_t>{116 * 512 * 2, 12 * 512 * 2}));
  std::vector<ScheduleTask> split;
  for (const ScheduleTask& t : tasks) {
    if (t.split) split.push_back(t);
  }
  ASSERT_EQ(split.size(), 2u);
  EXPECT_EQ(split[0].sender, 0);
  EXPECT_EQ(split[0].row_begin, 384);
  EXPECT_EQ(split[0].row_end, 500);
  EXPECT_EQ(split[0].scale_bytes, 16u);  // 4 blocks of 128 columns
  EXPECT_EQ(split[1].sender, 1);
  EXPECT_EQ(split[1].row_begin, 500);
  EXPECT_EQ(split[1].row_end, 512);
  EXPECT_EQ(split[1].scale_bytes, 0u);
  NetworkModel m{.nic_gbps = 100, .message_overhead_us = 0, .barrier_ms = 0};
  auto term = [&](const Prediction& pred, const std::string& name) {
    for (const Term& t : pred.groups.at(0).terms) {
      if (t.name == name) return t.seconds;
    }
    ADD_FAILURE() << "no term " << name;
    return 0.0;
  };
  const Prediction without = predict(*loads, m);
  m.maxima_ms = 7;
  const Prediction with = predict(*loads, m);
  EXPECT_NEAR(term(with, "sender NIC out"), term(without, "sender NIC out") + 7e-3, 1e-12);
  // 7 ms of the round outlast every other term.
  EXPECT_EQ(with.groups.at(0).bound, "sender NIC out");
  EXPECT_NEAR(with.seconds, term(with, "sender NIC out") + with.groups.at(0).fill_seconds, 1e-12);
}

TEST(Cluster, RefusesBadOptionsNamingThem) {
  auto error = [](ClusterOptions o) {
    o.sensitivity = false;
    auto r = simulate_cluster(o);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.status().message();
  };
  EXPECT_NE(error({.model = "kimi-k3"}).find("`model` 'kimi-k3'"), std::string::npos);
  EXPECT_NE(error({.trainers = 0}).find("`trainers` 0"), std::string::npos);
  EXPECT_NE(error({.receivers = 100})
                .find("`receivers` 100 is not a multiple of "
                      "`gpus_per_node` 8"),
            std::string::npos);
  EXPECT_NE(error({.engine_gpus = 24}).find("`engine_gpus` 24"), std::string::npos);
  EXPECT_NE(error({.shard_dtype = DType::kF16}).find("`shard_dtype` F16"), std::string::npos);
  ClusterOptions slow;
  slow.network.nic_gbps = 0;
  EXPECT_NE(error(slow).find("`nic_gbps` 0"), std::string::npos);
  ClusterOptions shared;
  shared.network.gpus_per_nic = 3;
  EXPECT_NE(error(shared).find("`gpus_per_node` 8 is not a multiple of `gpus_per_nic` 3"),
            std::string::npos);
}

TEST(Cluster, ReducedK2RunHasASensitivityTableAndADominantAssumption) {
  auto s = simulate_cluster(small_cluster());
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->params, k2_param_count(small_k2()));
  EXPECT_GT(s->prediction.seconds, 0);
  EXPECT_EQ(s->replica_bytes, s->prediction.total_bytes / 2);  // two engines
  std::vector<std::string> names;
  for (const Sensitivity& r : s->sensitivity) names.push_back(r.name);
  for (const char* needle : {"nic_gbps", "engine_gpus", "trainers"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), needle), names.end()) << needle;
  }
  ASSERT_GE(s->dominant, 0);
  EXPECT_LT(s->dominant, int(s->sensitivity.size()));
}

}  // namespace
}  // namespace wl::transfer
