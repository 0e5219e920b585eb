// The planner on ranks that exist only on paper: every receiver byte written exactly once,
// bands split only where a block band crosses shards, senders balanced by bytes, the JSON round
// trip and its version check, and every bad input refused with the tensor and rank named.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "fixture.h"
#include "weightlift/transfer/layout/layout_spec.h"
#include "weightlift/transfer/plan/offline_metadata.h"
#include "weightlift/transfer/plan/planner.h"

namespace wl::transfer {
namespace {

using testing::paper_receiver_or_die;
using testing::preset_or_die;

struct Shape_ {
  const char* preset;
  int meshes, mesh_size, tp;
  WeightFormat format;
};

std::vector<RankMeta> paper_world(const Shape_& s) {
  const model::ModelConfig c = preset_or_die(s.preset);
  std::vector<RankMeta> m;
  for (int i = 0; i < s.meshes * s.mesh_size; ++i) {
    m.push_back(paper_trainer(c, i, i / s.mesh_size, i % s.mesh_size, s.mesh_size));
  }
  for (int r = 0; r < s.tp; ++r) {
    m.push_back(
        paper_receiver_or_die(c, int(m.size()), {.tp = s.tp, .tp_rank = r, .format = s.format}));
  }
  return m;
}

// Each receiver's tensor bytes are covered by task ranges exactly once: no gap, no overlap.
void expect_exact_cover(const Plan& p, std::span<const RankMeta> metas) {
  for (const RankMeta& m : metas) {
    if (m.role != Role::kReceiver) continue;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const PlanTask& t : p.tasks) {
      if (t.receiver != m.rank) continue;
      ranges.push_back({t.dst_offset, t.dst_offset + t.bytes});
      if (t.scale_bytes) ranges.push_back({t.scale_offset, t.scale_offset + t.scale_bytes});
    }
    std::vector<std::pair<uint64_t, uint64_t>> want;
    for (const TensorMeta& t : m.tensors) want.push_back({t.offset, t.offset + t.bytes});
    std::sort(ranges.begin(), ranges.end());
    std::sort(want.begin(), want.end());
    // Merge touching ranges on both sides, then compare.
    auto merge = [&](const std::vector<std::pair<uint64_t, uint64_t>>& in) {
      std::vector<std::pair<uint64_t, uint64_t>> out;
      for (auto r : in) {
        EXPECT_TRUE(out.empty() || r.first >= out.back().second)
            << "overlap at byte " << r.first << " of receiver rank " << m.rank;
        if (!out.empty() && out.back().second == r.first) {
          out.back().second = r.second;
        } else {
          out.push_back(r);
        }
      }
      return out;
    };
    const auto merged = merge(ranges);
    want = merge(want);
    EXPECT_EQ(merged, want) << "receiver rank " << m.rank;
  }
}

TEST(Planner, CoversEveryReceiverByteExactlyOnce) {
  for (const Shape_& s :
       {Shape_{"tiny", 1, 1, 1, WeightFormat::kBF16}, Shape_{"tiny", 1, 2, 2, WeightFormat::kBF16},
        Shape_{"tiny", 1, 3, 2, WeightFormat::kFP8}, Shape_{"tiny", 2, 2, 4, WeightFormat::kFP8},
        Shape_{"small", 1, 2, 2, WeightFormat::kFP8}}) {
    SCOPED_TRACE(std::string(s.preset) + " meshes " + std::to_string(s.meshes) + "x" +
                 std::to_string(s.mesh_size) + " tp " + std::to_string(s.tp));
    const std::vector<RankMeta> metas = paper_world(s);
    auto plan = make_plan(metas);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    expect_exact_cover(*plan, metas);
    // Dense before experts.
    bool seen_expert = false;
    for (const PlanTask& t : plan->tasks) {
      EXPECT_FALSE(seen_expert && !t.expert) << t.tensor;
      seen_expert = seen_expert || t.expert;
    }
  }
}

TEST(Planner, Bf16SendsEverythingStraightFromShards) {
  auto plan = make_plan(paper_world({"tiny", 1, 2, 2, WeightFormat::kBF16}));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->maxima_floats, (std::vector<int64_t>{0}));
  for (const PlanTask& t : plan->tasks) EXPECT_EQ(t.maxima, -1) << t.tensor;
}

TEST(Planner, Fp8SplitsOnlyBandsThatCrossShards) {
  // small, one mesh of 2, tp 2: q_proj [256, 256] shards at row 128, and each rank's 128 query
  // rows are one band inside one shard: whole. The k/v band (64 rows: k rows of one head, v
  // rows of one head) reads rows of k and v that straddle both shards: split, each mesh rank
  // sending the rows it holds, all with the band's shared maxima.
  auto plan = make_plan(paper_world({"small", 1, 2, 2, WeightFormat::kFP8}));
  ASSERT_TRUE(plan.ok());
  int whole_q = 0;
  std::map<std::pair<int, int64_t>, std::vector<const PlanTask*>> split;  // by receiver, band
  for (const PlanTask& t : plan->tasks) {
    if (t.tensor != "layers.0.attn.qkv_proj.weight") continue;
    if (t.row_begin == 0) {
      EXPECT_EQ(t.maxima, -1);
      EXPECT_GT(t.scale_bytes, 0u);
      ++whole_q;
    } else {
      ASSERT_GE(t.maxima, 0);
      split[{t.receiver, t.row_begin / 128 * 128}].push_back(&t);
    }
  }
  EXPECT_EQ(whole_q, 2);
  ASSERT_EQ(split.size(), 2u);  // one k/v band per receiver
  for (const auto& [band, subs] : split) {
    std::set<int> senders;
    int scales = 0;
    for (const PlanTask* t : subs) {
      EXPECT_EQ(t->maxima, subs[0]->maxima) << "one band, one set of maxima";
      EXPECT_EQ(t->row_end - t->row_begin, t->bytes / uint64_t(t->cols));
      senders.insert(t->sender);
      // The sub-band at the band's first row writes its scale row; the others none.
      scales += t->scale_bytes > 0;
      EXPECT_EQ(t->scale_bytes > 0, t->row_begin == band.second) << t->row_begin;
      for (const PlanPiece& q : t->pieces) {
        EXPECT_TRUE(q.param == "layers.0.attn.k_proj.weight" ||
                    q.param == "layers.0.attn.v_proj.weight")
            << q.param;
      }
    }
    EXPECT_EQ(scales, 1);
    EXPECT_EQ(senders, (std::set<int>{0, 1})) << "both shards hold rows of the band";
  }
  EXPECT_GT(plan->maxima_floats.at(0), 0);
  // A mesh of one holds every band whole.
  auto single = make_plan(paper_world({"small", 1, 1, 2, WeightFormat::kFP8}));
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->maxima_floats, (std::vector<int64_t>{0}));
}

// Trainer ranks holding whole parameters, as pipeline stages do (`stage` of each parameter),
// instead of torch.chunk's rows of each.
void hold_by_stage(std::vector<RankMeta>& metas,
                   const std::function<int(const std::string&)>& stage) {
  for (RankMeta& m : metas) {
    if (m.role != Role::kTrainer) continue;
    for (ParamMeta& p : m.params) {
      const int owner = stage(p.name);
      p.row_begin = m.mesh_rank <= owner ? 0 : p.shape[0];
      p.row_end = m.mesh_rank < owner ? 0 : p.shape[0];
    }
  }
}

TEST(Planner, ReadsWholeLayersFromTheStageThatHoldsThem) {
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kFP8}) {
    std::vector<RankMeta> metas = paper_world({"tiny", 1, 2, 2, format});
    auto stage = [](const std::string& name) {
      return name.starts_with("embed") || name.starts_with("layers.0.") ? 0 : 1;
    };
    hold_by_stage(metas, stage);
    auto plan = make_plan(metas);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    expect_exact_cover(*plan, metas);
    // Every piece comes from the stage holding its parameter, every band whole: a fused
    // tensor's parameters are one layer's, on one stage.
    EXPECT_EQ(plan->maxima_floats, (std::vector<int64_t>{0}));
    std::vector<uint64_t> bytes(2, 0);
    for (const PlanTask& t : plan->tasks) {
      EXPECT_EQ(t.maxima, -1) << t.tensor;
      for (const PlanPiece& q : t.pieces) EXPECT_EQ(stage(q.param), t.sender) << q.param;
      bytes[size_t(t.sender)] += t.total_bytes();
    }
    EXPECT_GT(bytes[0], 0u);
    EXPECT_GT(bytes[1], bytes[0]);  // layer 1 and the head
  }
  // Two meshes must hold their rows alike: mesh 1 by stages, mesh 0 by torch.chunk, refused.
  std::vector<RankMeta> metas = paper_world({"tiny", 2, 2, 2, WeightFormat::kBF16});
  std::vector<RankMeta> mesh1(metas.begin() + 2, metas.begin() + 4);
  hold_by_stage(mesh1, [](const std::string&) { return 1; });
  std::copy(mesh1.begin(), mesh1.end(), metas.begin() + 2);
  auto plan = make_plan(metas);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("every mesh holds the same rows"), std::string::npos)
      << plan.status().message();
  EXPECT_NE(plan.status().message().find("trainer rank 2"), std::string::npos)
      << plan.status().message();
}

TEST(Planner, ReplicasShareTheBytes) {
  // Two meshes of one: every byte can come from either; the fewest-bytes rule keeps them
  // within one task of each other.
  auto plan = make_plan(paper_world({"small", 2, 1, 2, WeightFormat::kBF16}));
  ASSERT_TRUE(plan.ok());
  const std::vector<uint64_t> bytes = plan_bytes_by_rank(*plan);
  uint64_t largest = 0;
  for (const PlanTask& t : plan->tasks) largest = std::max(largest, t.total_bytes());
  EXPECT_GT(bytes[0], 0u);
  EXPECT_LE(bytes[0] > bytes[1] ? bytes[0] - bytes[1] : bytes[1] - bytes[0], largest);
  EXPECT_EQ(plan->num_meshes, 2);
  EXPECT_EQ(plan->mesh_size, 1);
}

TEST(Planner, JsonRoundTripsAndRefusesOtherVersions) {
  auto plan = make_plan(paper_world({"tiny", 2, 2, 2, WeightFormat::kFP8}));
  ASSERT_TRUE(plan.ok());
  const std::string json = plan_to_json(*plan);
  auto back = plan_from_json(json, "test");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(plan_to_json(*back), json);

  std::string v4 = json;
  const std::string field = "\"format_version\": 3";
  const size_t at = v4.find(field);
  ASSERT_NE(at, std::string::npos) << json.substr(0, 200);
  v4.replace(at, field.size(), "\"format_version\": 4");
  auto other = plan_from_json(v4, "plan.json");
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find(
                "plan.json: transfer plan format version 4, this build reads version 3; plan "
                "again with this build"),
            std::string::npos)
      << other.status().message();
  // A sub-band reading maxima past its mesh's shared ones, or a count per mesh missing.
  nlohmann::json j = nlohmann::json::parse(json);
  j["tasks"][0]["maxima"] = int64_t(1) << 40;
  auto past = plan_from_json(j.dump(), "plan.json");
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("reads block maxima outside its mesh's shared maxima"),
            std::string::npos)
      << past.status().message();
  j = nlohmann::json::parse(json);
  j["maxima_floats"].erase(0);
  EXPECT_FALSE(plan_from_json(j.dump(), "plan.json").ok());
  j = nlohmann::json::parse(json);
  j["maxima_floats"][0] = -4;
  EXPECT_FALSE(plan_from_json(j.dump(), "plan.json").ok());
  j = nlohmann::json::parse(json);
  j["trainers"][0]["mesh"] = 7;
  EXPECT_FALSE(plan_from_json(j.dump(), "plan.json").ok());
  // Maxima only for fp8 rows inside one band.
  j = nlohmann::json::parse(json);
  j["maxima_floats"] = {1000, 1000};
  for (auto& task : j["tasks"]) {
    if (task["dtype"] != "BF16") continue;
    task["maxima"] = 0;
    break;
  }
  EXPECT_FALSE(plan_from_json(j.dump(), "plan.json").ok());
  EXPECT_EQ(plan_from_json("{\"format\": \"x\"}", "p").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(plan_from_json("not json", "p").status().code(), StatusCode::kDataLoss);
}

void expect_refused(std::span<const RankMeta> metas, StatusCode code,
                    std::initializer_list<std::string> words) {
  auto plan = make_plan(metas);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), code) << plan.status().to_string();
  for (const std::string& w : words) {
    EXPECT_NE(plan.status().message().find(w), std::string::npos)
        << "'" << w << "' not in: " << plan.status().message();
  }
}

TEST(Planner, RefusesBadInputNamingTensorAndRank) {
  const model::ModelConfig c = preset_or_die("tiny");
  std::vector<RankMeta> base = paper_world({"tiny", 1, 2, 2, WeightFormat::kFP8});  // 0,1 | 2,3

  auto unknown = base;
  unknown[3].tensors[5].name = "layers.0.attn.qkvz_proj.weight";
  expect_refused(unknown, StatusCode::kNotFound,
                 {"receiver rank 3", "'layers.0.attn.qkvz_proj.weight'", "no trainer parameter"});

  model::ModelConfig wide = c;
  wide.ffn_dim = 256;
  auto shape = base;
  shape[2] = paper_receiver_or_die(wide, 2, {.tp = 2, .tp_rank = 0, .format = WeightFormat::kFP8});
  expect_refused(shape, StatusCode::kInvalidArgument,
                 {"receiver rank 2", "'layers.0.moe.experts.0.gate_up_proj.weight'", "[256, 64]",
                  "[128, 64]"});

  auto tp3 = base;
  tp3[3].tp = 3;
  expect_refused(tp3, StatusCode::kInvalidArgument,
                 {"receiver rank 3", "tp 3 does not divide num_heads 4"});

  auto missing = base;
  missing[1].params.erase(missing[1].params.begin() + 3);
  expect_refused(missing, StatusCode::kNotFound,
                 {"trainer rank 1", "'layers.0.attn.k_proj.weight'"});

  auto wrong_rows = base;
  wrong_rows[0].params[0].row_end += 1;
  expect_refused(wrong_rows, StatusCode::kInvalidArgument, {"trainer rank 0", "'embed.weight'"});
  auto short_rows = base;
  short_rows[1].params[0].row_end -= 1;
  expect_refused(short_rows, StatusCode::kInvalidArgument,
                 {"trainer rank 1, the last of mesh 0", "'embed.weight'", "the mesh's ranks hold"});

  auto dtype = base;
  dtype[2].tensors[2].dtype = DType::kBF16;  // layers.0.attn.qkv_proj.weight: e4m3 in fp8
  expect_refused(dtype, StatusCode::kInvalidArgument,
                 {"receiver rank 2", dtype[2].tensors[2].name, "F8_E4M3"});
}

// Trainers holding another model's weights (a layout spec, not our config): whole meshes of
// one spec, receivers made of what the spec says at their TP rank; a spec whose split does
// not divide, a trainer of another spec or of our model, and a metadata record with neither
// or both are refused naming the rank.
RankMeta spec_trainer(const LayoutSpec& spec, int rank, int mesh_rank, int mesh_size) {
  RankMeta m{.rank = rank, .role = Role::kTrainer};
  m.layout_json = layout_spec_to_json(spec);
  m.mesh_rank = mesh_rank;
  m.mesh_size = mesh_size;
  for (const auto& [name, shape] : spec.params) {
    const ShardRows r = shard_rows(shape[0], mesh_size, mesh_rank);
    m.params.push_back({name, shape, DType::kF32, r.begin, r.end, false});
  }
  return m;
}

TEST(Planner, PlansALayoutSpecsModelAndRefusesWhatDoesNotFit) {
  const model::ModelConfig c = preset_or_die("tiny");
  const LayoutSpec spec = llama_hf_layout_spec(c, WeightFormat::kFP8);
  std::vector<RankMeta> world = {spec_trainer(spec, 0, 0, 2), spec_trainer(spec, 1, 1, 2)};
  for (int r = 0; r < 2; ++r) {
    const LayoutOptions o{.tp = 2, .tp_rank = r, .format = WeightFormat::kFP8};
    auto lay = spec_layout(spec, 2, r);
    ASSERT_TRUE(lay.ok()) << lay.status().to_string();
    world.push_back(paper_receiver(2 + r, tensor_specs(*lay), o));
  }
  auto plan = make_plan(world);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_TRUE(plan->config_json.empty());
  bool fused = false;
  for (const PlanTask& t : plan->tasks) {
    fused |= t.tensor == "model.layers.0.self_attn.qkv_proj.weight" && t.quantized();
  }
  EXPECT_TRUE(fused);
  auto back = plan_from_json(plan_to_json(*plan), "test");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->layout_name, "llama-hf");
  EXPECT_EQ(plan_to_json(*back), plan_to_json(*plan));
  nlohmann::json bare = nlohmann::json::parse(plan_to_json(*plan));
  bare.erase("layout");  // neither a config nor a layout: not a plan
  const auto unnamed = plan_from_json(bare.dump(), "plan.json");
  EXPECT_EQ(unnamed.status().code(), StatusCode::kDataLoss) << unnamed.status().to_string();
  EXPECT_NE(unnamed.status().message().find("exactly one of \"config\" and \"layout\""),
            std::string::npos)
      << unnamed.status().to_string();

  auto tp3 = world;
  tp3[3].tp = 3;
  expect_refused(tp3, StatusCode::kInvalidArgument,
                 {"receiver rank 3", "layout 'llama-hf' at tp 3", "self_attn.qkv_proj.weight"});

  LayoutSpec other = spec;
  other.name = "llama-hf-2";
  auto mixed = world;
  mixed[1] = spec_trainer(other, 1, 1, 2);
  expect_refused(mixed, StatusCode::kInvalidArgument,
                 {"trainer rank 1", "layout spec differs from trainer rank 0's"});

  auto ours = world;
  ours[1] = paper_trainer(c, 1, 0, 1, 2);
  expect_refused(ours, StatusCode::kInvalidArgument,
                 {"trainer rank 1", "our model's weights, trainer rank 0 the other kind"});

  // On the wire: "config" or "layout", not both, not neither.
  RankMeta both = world[0];
  both.config_json = model::config_to_json(c);
  RankMeta neither = world[0];
  neither.layout_json.clear();
  for (const RankMeta& bad : {both, neither}) {
    auto m = metadata_from_json(metadata_to_json(bad), "rank 0's metadata");
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("exactly one of \"config\" and \"layout\""),
              std::string::npos)
        << m.status().to_string();
  }
}

// plan_offline: the job a command line describes, planned as a running job would be.
TEST(OfflinePlan, IsThePlanOfTheSamePaperRanks) {
  const model::ModelConfig c = preset_or_die("tiny");
  auto plan = plan_offline({.config = c, .trainers = 2, .mesh_size = 1, .receivers = 2, .tp = 2});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->num_meshes, 2);
  ASSERT_EQ(plan->receivers.size(), 2u);
  EXPECT_EQ(plan->receivers[1].rank, 3);
  EXPECT_EQ(plan->receivers[1].tp_rank, 1);
  std::vector<RankMeta> ranks = {paper_trainer(c, 0, 0, 0, 1), paper_trainer(c, 1, 1, 0, 1)};
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(paper_receiver_or_die(c, 2 + r, {.tp = 2, .tp_rank = r}));
  }
  auto direct = make_plan(ranks);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(plan_to_json(*direct), plan_to_json(*plan));
}

TEST(OfflinePlan, BadJobsAreClearErrors) {
  const model::ModelConfig c = preset_or_die("tiny");
  auto refused = [&](OfflineJob job, const std::string& says) {
    job.config = c;
    auto r = plan_offline(job);
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().message();
  };
  refused({.trainers = 0}, "need at least one trainer");
  refused({.trainers = 3, .mesh_size = 2}, "mesh size 2 does not divide the 3 trainers");
  refused({.receivers = 3, .tp = 2}, "tp 2 does not divide the 3 receivers");
  // tiny has 4 heads: TP 8 cannot split them; the first receiver (world rank 2) is named.
  refused({.receivers = 8, .tp = 8}, "receiver rank 2");
  refused({.receivers = 4, .tp = 2, .ep = 3}, "tp 2 x ep 3 = 6 does not divide the 4 receivers");
  // tiny has 4 experts: EP 3 cannot split them evenly.
  refused({.receivers = 3, .tp = 1, .ep = 3}, "ep 3 does not divide the model's 4 experts");
}

// An engine of EP ranks: each rank receives exactly its run of the experts and every dense
// tensor, so its bytes are the dense bytes plus a 1/ep share of the experts', and the ranks of
// an engine together receive one TP-1 engine's bytes plus (ep - 1) copies of the dense ones.
TEST(OfflinePlan, ExpertParallelRanksReceiveTheirOwnExpertsOnly) {
  const model::ModelConfig c = preset_or_die("tiny");
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
    auto one = plan_offline({.config = c, .trainers = 2, .receivers = 1, .tp = 1, .format = f});
    auto ep =
        plan_offline({.config = c, .trainers = 2, .receivers = 4, .tp = 1, .ep = 4, .format = f});
    ASSERT_TRUE(one.ok() && ep.ok()) << ep.status().to_string();
    ASSERT_EQ(ep->receivers.size(), 4u);
    uint64_t dense = 0, experts = 0;
    for (const PlanTask& t : one->tasks) (t.expert ? experts : dense) += t.total_bytes();
    const std::vector<uint64_t> bytes = plan_bytes_by_rank(*ep);
    for (const PlanReceiver& r : ep->receivers) {
      EXPECT_EQ(r.ep, 4);
      EXPECT_EQ(r.ep_rank, r.rank - 2);
      EXPECT_EQ(bytes[size_t(r.rank)], dense + experts / 4) << "receiver rank " << r.rank;
      for (const PlanTask& t : ep->tasks) {
        if (t.receiver != r.rank || !t.expert) continue;
        const std::string own = "moe.experts." + std::to_string(r.ep_rank) + ".";
        EXPECT_NE(t.tensor.find(own), std::string::npos) << t.tensor << " to ep rank " << r.ep_rank;
      }
    }
    // The JSON carries the EP rank.
    auto back = plan_from_json(plan_to_json(*ep), "the plan");
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->receivers[3].ep_rank, 3);
  }
}

}  // namespace
}  // namespace wl::transfer
