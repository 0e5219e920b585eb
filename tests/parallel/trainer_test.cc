// The trainer on one process and on data-parallel ranks (threads here, each rank with its own
// UCX workers): resuming bit-exactly, f16 loss scaling, bad inputs; FSDP holds a fraction of
// the state. (layout_test.cc compares every layout with one process; checkpoint_test.cc moves
// checkpoints between layouts.)
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>

#include "train_ranks.h"
#include "weightlift/comm/store/memory_store.h"
#include "weightlift/comm/transport/fault_transport.h"
#include "weightlift/core/random.h"
#include "weightlift/core/shard.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/model/pass.h"
#include "weightlift/model/units.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/parallel/pipeline/pipeline.h"
#include "weightlift/parallel/run/state_bytes.h"
#include "weightlift/train/checkpoint_state.h"

namespace wl::parallel {
namespace {

using testing::expect_same_bits;
using testing::fresh_dir;
using testing::kCurveTolerance;
using testing::layout_options;
using testing::make_corpus;
using testing::read_lines;
using testing::read_weights;
using testing::run_data_parallel;
using testing::tiny_options;
using testing::train_on;

TEST(Trainer, ResumeContinuesBitExactly) {
  const TrainOptions o = tiny_options(make_corpus());
  TrainOptions straight = o;
  straight.out_dir = fresh_dir("straight");
  ASSERT_TRUE(train(straight).ok());

  // The first run goes on to step 5 after checkpointing step 3; the resumed run redoes 4 and 5.
  TrainOptions first = o;
  first.out_dir = fresh_dir("first");
  first.stop_after = 5;
  first.checkpoint_every = 3;
  ASSERT_TRUE(train(first).ok());
  TrainOptions second = o;
  second.out_dir = first.out_dir;
  second.resume = first.out_dir + "/checkpoint-3";
  auto r = train(second);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->steps, 6);
  expect_same_bits(straight.out_dir + "/model.safetensors", first.out_dir + "/model.safetensors");
  // The loss curve continues exactly: the same six loss values in both metrics files, steps
  // 4 and 5 of the first run replaced rather than repeated.
  std::vector<std::string> la = read_lines(straight.out_dir + "/metrics.jsonl");
  std::vector<std::string> lb = read_lines(first.out_dir + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    auto field = [](const std::string& l) { return l.substr(l.find("\"loss\""), 30); };
    EXPECT_EQ(field(la[i]), field(lb[i])) << "step " << i + 1;
    EXPECT_NE(lb[i].find("\"step\":" + std::to_string(i + 1) + ","), std::string::npos) << lb[i];
  }
  // A damaged metrics file is refused, naming the line, and left as it was.
  const std::string metrics = first.out_dir + "/metrics.jsonl";
  {
    std::ofstream f(metrics, std::ios::trunc);
    f << lb[0] << "\n"
      << "not json\n"
      << lb[2] << "\n";
  }
  auto damaged = train(second);
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss) << damaged.status().to_string();
  EXPECT_NE(damaged.status().message().find("metrics.jsonl:2"), std::string::npos)
      << damaged.status().to_string();
  EXPECT_EQ(read_lines(metrics).size(), 3u);
}

// f16 needs loss scaling: the scaler starts at 2^16 and halves whenever a scaled gradient
// overflows f16 (that update is skipped). Training must still proceed and lower the loss.
TEST(Trainer, F16WithDynamicLossScalingTrains) {
  TrainOptions o = tiny_options(make_corpus());
  o.steps = 30;
  o.eval_windows = 2;
  o.precision = model::Precision::kF16;
  o.out_dir = fresh_dir("f16");
  auto r = train(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<std::string> lines = read_lines(o.out_dir + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 30u);
  auto number = [](const std::string& l, const std::string& key) {
    const size_t p = l.find("\"" + key + "\":");
    return std::stod(l.substr(p + key.size() + 3));
  };
  int skipped = 0;
  for (const std::string& l : lines) skipped += l.find("\"skipped\":true") != std::string::npos;
  EXPECT_LT(skipped, 30);
  EXPECT_LT(number(lines.back(), "loss"), number(lines.front(), "loss"));
  // The same run in f32 differs: f16 rounding really happened.
  TrainOptions f32 = o;
  f32.precision = model::Precision::kF32;
  f32.out_dir = fresh_dir("f32");
  ASSERT_TRUE(train(f32).ok());
  const std::vector<std::string> ref = read_lines(f32.out_dir + "/metrics.jsonl");
  EXPECT_NE(number(ref.back(), "loss"), number(lines.back(), "loss"));
}

TEST(Trainer, BadInputsAreClearErrors) {
  TrainOptions o;
  o.out_dir = fresh_dir("bad");
  o.preset = "huge";
  auto r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("huge"), std::string::npos);

  o.preset = "tiny";
  o.corpus_dir = "/nonexistent/brown";
  r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);

  o.corpus_dir = make_corpus();
  o.resume = o.out_dir + "/no-such-checkpoint";
  r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no-such-checkpoint"), std::string::npos);

  // A global batch that the micro-batches and ranks do not divide, named by its field.
  o.resume.clear();
  o.batch = 6;
  o.layout.micro_batches = 4;
  r = train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("`batch` 6 must be a multiple of 4"), std::string::npos)
      << r.status().to_string();
}

// An expert-parallel group must divide the data-parallel ranks and the experts; the error
// names the field and what it must divide.
TEST(Layout, ExpertParallelSizeMustDivideRanksAndExperts) {
  const model::ModelConfig c = *model::preset("tiny");  // 4 experts
  const auto check = [&](int world, int pp, int ep) {
    return validate({.dp = world / pp, .pp = pp, .ep = ep}, world, c, 8);
  };
  EXPECT_TRUE(check(4, 1, 4).ok());
  EXPECT_TRUE(check(4, 2, 2).ok());
  const Status ranks = check(4, 2, 4);
  EXPECT_NE(ranks.message().find("`ep` 4 does not divide the data-parallel size 2"),
            std::string::npos)
      << ranks.to_string();
  const Status experts = check(6, 1, 3);
  EXPECT_NE(experts.message().find("`ep` 3 does not divide the 4 experts"), std::string::npos)
      << experts.to_string();
  EXPECT_FALSE(check(2, 1, 0).ok());
}

// --pp-schedule auto: zero bubble where the data-parallel mode keeps whole gradients until the
// step ends, 1F1B where it reduces them unit by unit, so the default never meets validate()'s
// refusal of ZB with ZeRO-2 and FSDP.
TEST(Layout, AutoScheduleIsZeroBubbleWhereTheGradientsStayWhole) {
  const model::ModelConfig c = *model::preset("tiny");
  for (DpMode mode : {DpMode::kDdp, DpMode::kZero1, DpMode::kZero2, DpMode::kFsdp}) {
    const Result<PipelineSchedule> s = parse_schedule_flag("auto", mode);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    const bool whole = mode == DpMode::kDdp || mode == DpMode::kZero1;
    EXPECT_EQ(*s, whole ? PipelineSchedule::kZeroBubble : PipelineSchedule::k1F1B)
        << dp_mode_name(mode);
    const ParallelLayout l{.dp_mode = mode, .dp = 2, .pp = 2, .schedule = *s, .micro_batches = 4};
    EXPECT_TRUE(validate(l, 4, c, 8).ok()) << dp_mode_name(mode);
  }
  EXPECT_EQ(*parse_schedule_flag("gpipe", DpMode::kFsdp), PipelineSchedule::kGPipe);
  const Status bad = parse_schedule_flag("zigzag", DpMode::kDdp).status();
  EXPECT_NE(bad.message().find("`schedule` 'zigzag': expected auto, 1f1b, gpipe or zb"),
            std::string::npos)
      << bad.to_string();
}

TEST(Layout, TensorParallelSizeMustDivideRanksHeadsAndFfnRows) {
  const model::ModelConfig c = *model::preset("tiny");  // 4 heads, 1 kv head, ffn 128
  const auto check = [&](int world, int pp, int tp, int ep = 1) {
    const int dp = tp > 0 ? world / (pp * tp) : 1;
    return validate({.dp = dp, .pp = pp, .tp = tp, .ep = ep}, world, c, 8);
  };
  EXPECT_TRUE(check(2, 1, 2).ok());
  EXPECT_TRUE(check(8, 2, 4).ok());
  const Status heads = check(3, 1, 3);
  EXPECT_NE(heads.message().find("`tp`: tp 3 does not divide num_heads 4"), std::string::npos)
      << heads.to_string();
  const Status ranks = check(6, 1, 4);
  EXPECT_NE(ranks.message().find("`tp` 4 does not divide the 6 ranks"), std::string::npos)
      << ranks.to_string();
  EXPECT_TRUE(check(4, 1, 2, 2).ok());       // TP 2 x EP 2, Megatron's composition
  const Status experts = check(4, 1, 2, 4);  // EP over the data-parallel ranks of a TP rank
  EXPECT_NE(experts.message().find("`ep` 4 does not divide the data-parallel size 2"),
            std::string::npos)
      << experts.to_string();
  const Status cut = check(4, 4, 2);
  EXPECT_NE(cut.message().find("`pp` 4 x `tp` 2 = 8 does not divide the 4 ranks"),
            std::string::npos)
      << cut.to_string();
  EXPECT_FALSE(check(2, 1, 0).ok());
}

// DataParallel's hooks, handed on, with `arm` called just before the `nth` row exchange: the
// test arms a transport fault there, so the failure takes the trainer's own path (the expert
// group keeps it, the block runs on with zero rows, after_unit stops the pass).
class ArmBeforeRowExchange final : public model::PassHooks, public model::ExpertExchange {
 public:
  ArmBeforeRowExchange(DataParallel& dp, int nth, std::function<void()> arm)
      : dp_(dp), inner_(*dp.expert_exchange()), nth_(nth), arm_(std::move(arm)) {}
  Status before_unit(int u, model::Direction d, model::ModelView& w, model::ModelView& g) override {
    return dp_.before_unit(u, d, w, g);
  }
  Status after_unit(int u, model::Direction d, model::ModelView& w, model::ModelView& g) override {
    return dp_.after_unit(u, d, w, g);
  }
  int64_t sum_router_counts(int layer, int64_t* counts, int64_t experts, int64_t n) override {
    return dp_.sum_router_counts(layer, counts, experts, n);
  }
  model::ExpertExchange* expert_exchange() override { return this; }
  int ranks() const override { return inner_.ranks(); }
  int rank() const override { return inner_.rank(); }
  Status exchange_counts(const int64_t* send, int64_t* recv, int64_t per_peer) override {
    return inner_.exchange_counts(send, recv, per_peer);
  }
  Status exchange_rows(const float* send, std::span<const int64_t> send_rows, float* recv,
                       std::span<const int64_t> recv_rows, int64_t width) override {
    if (++calls_ == nth_ && arm_) arm_();
    return inner_.exchange_rows(send, send_rows, recv, recv_rows, width);
  }

 private:
  DataParallel& dp_;
  model::ExpertExchange& inner_;
  int nth_, calls_ = 0;
  std::function<void()> arm_;
};

// Two thread-ranks of `layout` on tiny, each at the first micro-batch of a step from init seed
// 5, whose compute groups run on fault-injecting transports and wait 2 s in a collective:
// forward(rank, its transport, its DataParallel) runs a pass, and its statuses are returned.
// Every rank must be done within one collective's timeout and the setup.
std::vector<Status> forward_with_faults(
    const ParallelLayout& layout,
    const std::function<Status(int, comm::FaultTransport&, DataParallel&)>& forward) {
  const model::ModelConfig c = *model::preset("tiny");
  auto store = std::make_shared<comm::MemoryStore>();
  std::vector<Status> out(2, internal_error("did not run"));
  const auto started = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto t = comm::FaultTransport::create({.name = "rank " + std::to_string(r)});
      ASSERT_TRUE(t.ok());
      auto group = comm::Group::connect({.store = store,
                                         .rank = r,
                                         .size = 2,
                                         .timeout = std::chrono::seconds(2),
                                         .transport = *t,
                                         .ids_key = "ids"});
      auto queue = comm::Group::connect({.store = store,
                                         .rank = r,
                                         .size = 2,
                                         .timeout = std::chrono::seconds(5),
                                         .prefix = "q"});
      ASSERT_TRUE(group.ok() && queue.ok());
      auto dp = make_data_parallel(c, layout, {}, std::chrono::seconds(2), {*group, *queue});
      ASSERT_TRUE(dp.ok()) << dp.status().to_string();
      std::vector<float> init(size_t((*dp)->layout().total()));
      model::init_params(c, (*dp)->layout(), 5, init.data());
      (*dp)->set_params(init.data());
      (*dp)->begin_step();
      (*dp)->begin_micro_batch(0);
      out[size_t(r)] = forward(r, **t, **dp);
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("rank 0: %s\nrank 1: %s\n", out[0].to_string().c_str(), out[1].to_string().c_str());
  EXPECT_LT(seconds, 2.0 + 4.0) << "one collective's timeout and the setup at most";
  return out;
}

// Rank 0's send fails in the third row exchange (layer 1's forward): both ranks stop their
// pass with an error, rank 0's naming the exchange, within one collective's timeout.
TEST(ExpertParallel, AFailedExchangeStopsEveryRankNamingIt) {
  const int64_t rows = 2, seq = 16;
  std::vector<int64_t> tokens(size_t(2 * rows * seq));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 37 % 301);
  const std::vector<Status> out = forward_with_faults(
      {.dp = 2, .ep = 2}, [&](int r, comm::FaultTransport& t, DataParallel& dp) {
        auto arm = [&t] { t.fail({.op = comm::TransportOp::kSend, .nth = 1}); };
        ArmBeforeRowExchange hooks(dp, 3, r == 0 ? std::function<void()>(arm) : nullptr);
        model::StagePass pass(dp.pass_model(), {0, dp.units().head()},
                              tokens.data() + r * rows * seq, rows, seq, {}, &hooks);
        return pass.forward(nullptr, true);
      });
  EXPECT_NE(out[0].message().find("exchanging expert rows (`ep`)"), std::string::npos)
      << out[0].to_string();
  EXPECT_FALSE(out[1].ok());  // its wait for rank 0's rows runs out: the injected fault
                              // closes nothing on rank 1's side
}

// Rank 0's first send under --tp 2 fails (the sum after layer 0's o_proj): both ranks stop
// their pass with an error, rank 0's naming the tensor-parallel sum, within one collective's
// timeout.
TEST(TensorParallel, AFailedSumStopsEveryRankNamingIt) {
  const int64_t rows = 2, seq = 16;
  std::vector<int64_t> tokens(size_t(rows * seq));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 37 % 301);
  const std::vector<Status> out = forward_with_faults(
      {.dp = 1, .tp = 2}, [&](int r, comm::FaultTransport& t, DataParallel& dp) {
        if (r == 0) t.fail({.op = comm::TransportOp::kSend, .nth = 1});
        model::StagePass pass(dp.pass_model(), {0, dp.units().head()}, tokens.data(), rows, seq, {},
                              &dp);
        return pass.forward(nullptr, true);
      });
  EXPECT_NE(out[0].message().find("summing over the tensor-parallel ranks (`tp`)"),
            std::string::npos)
      << out[0].to_string();
  EXPECT_FALSE(out[1].ok());
}

// Every TP rank updates its copy of the replicated parameters alike; a copy that differs is
// caught before a checkpoint is written, naming the parameter, whether the copies are whole
// (DDP) or sharded over data-parallel ranks (FSDP).
TEST(TensorParallel, ACopyThatDriftedIsNamed) {
  const model::ModelConfig c = testing::model_config("tiny");
  for (const auto& [ranks, mode] : {std::pair{2, DpMode::kDdp}, std::pair{4, DpMode::kFsdp}}) {
    run_data_parallel(ranks, c, {.dp_mode = mode, .tp = 2}, [&](DataParallel& dp) {
      std::vector<float> full(size_t(dp.layout().total()));
      model::init_params(c, dp.layout(), 3, full.data());
      dp.set_params(full.data());
      const Status same = dp.check_tp_replicas();
      EXPECT_TRUE(same.ok()) << same.to_string();
      // Every element of the norm: each data-parallel shard of it differs.
      const model::ParamInfo& p = dp.layout().at("layers.1.moe_norm.weight");
      if (dp.tp_rank() == 1) {
        for (int64_t i = 0; i < p.numel(); ++i) full[size_t(p.offset + i)] += 1;
      }
      dp.set_params(full.data());
      const Status drifted = dp.check_tp_replicas();
      EXPECT_EQ(drifted.code(), StatusCode::kFailedPrecondition) << drifted.to_string();
      EXPECT_NE(drifted.message().find("rank 1's copy of 'layers.1.moe_norm.weight' differs"),
                std::string::npos)
          << drifted.to_string();
    });
  }
  // Two kv heads over four TP ranks: ranks 2 and 3 share kv head 1, and rank 3's copy drifts.
  const model::ModelConfig gqa = testing::model_config("tiny_gqa");
  run_data_parallel(4, gqa, {.tp = 4}, [&](DataParallel& dp) {
    std::vector<float> full(size_t(dp.layout().total()));
    model::init_params(gqa, dp.layout(), 3, full.data());
    const model::ParamInfo& v = dp.layout().at("layers.0.attn.v_proj.weight");
    if (dp.tp_rank() == 3) full[size_t(v.offset + v.numel() - 1)] += 1;  // in kv head 1
    dp.set_params(full.data());
    const Status drifted = dp.check_tp_replicas();
    if (dp.tp_rank() < 2) {
      EXPECT_TRUE(drifted.ok()) << drifted.to_string();
    } else {
      EXPECT_NE(drifted.message().find("sharing a kv head, rank 1's copy of "
                                       "'layers.0.attn.v_proj.weight' differs"),
                std::string::npos)
          << drifted.to_string();
    }
  });
}

// ---- memory ----------------------------------------------------------------------------------

// Where a rank holds the whole model (one rank, or DDP and ZeRO, which keep parameters whole)
// whole_model() is a view of it: after a step it is what gather_model() copies and the same on
// every rank, the step's update included. Where parameters are sharded (FSDP) or cut into
// stages there is none.
TEST(DataParallel, WholeModelIsAViewWhereTheRankHoldsEveryParameter) {
  struct Case {
    const char* model;
    int ranks;
    ParallelLayout layout;
    bool whole;
  };
  for (const Case& k :
       {Case{"tiny_tied", 1, {}, true}, Case{"tiny", 2, {.dp_mode = DpMode::kDdp}, true},
        Case{"tiny_tied", 2, {.dp_mode = DpMode::kZero1}, true},
        Case{"tiny", 2, {.dp_mode = DpMode::kZero2}, true},
        Case{"tiny", 2, {.dp_mode = DpMode::kFsdp}, false},
        Case{"tiny_tied", 2, {.pp = 2, .micro_batches = 2}, false},
        Case{"tiny", 2, {.ep = 2}, false}, Case{"tiny", 2, {.tp = 2}, false}}) {
    const model::ModelConfig c = testing::model_config(k.model);
    const std::string what = std::string(k.model) + ", " + std::to_string(k.ranks) + " ranks, " +
                             std::string(dp_mode_name(k.layout.dp_mode)) + ", pp " +
                             std::to_string(k.layout.pp);
    train::Batch batch{4, 16, std::vector<int64_t>(64), std::vector<int64_t>(64)};
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
      batch.tokens[i] = int64_t(i * 7 % size_t(c.vocab_size));
      batch.targets[i] = int64_t((i * 7 + 3) % size_t(c.vocab_size));
    }
    std::mutex mu;
    std::vector<std::vector<float>> views(size_t(k.ranks));
    run_data_parallel(k.ranks, c, k.layout, [&](DataParallel& dp) {
      std::vector<float> initial(size_t(dp.layout().total()));
      model::init_params(c, dp.layout(), 3, initial.data());
      dp.set_params(initial.data());
      auto step = k.layout.pp > 1 ? Result<StepResult>(unavailable("no step: a pipeline"))
                                  : run_step(dp, batch, {.lr = 1e-2});
      const float* view = dp.whole_model();
      EXPECT_EQ(view != nullptr, k.whole) << what;
      if (view == nullptr) return;
      ASSERT_TRUE(step.ok()) << step.status().to_string();
      std::vector<float> gathered(initial.size());
      ASSERT_TRUE(dp.gather_model(gathered.data()).ok());
      EXPECT_TRUE(std::equal(gathered.begin(), gathered.end(), view)) << what;
      EXPECT_FALSE(std::equal(initial.begin(), initial.end(), view)) << what << ": no update";
      std::lock_guard lock(mu);
      views[size_t(dp.rank())].assign(view, view + initial.size());
    });
    for (const std::vector<float>& v : views) EXPECT_EQ(v, views[0]) << what << ": ranks differ";
  }
}

// FSDP on N ranks holds 1/N of what DDP holds (weights, gradients, AdamW's two moments) plus
// the units gathered at the moment: at most the current and the prefetched one, each with a
// unit's gradients while its backward runs.
TEST(Fsdp, HoldsAFractionOfTheState) {
  TrainOptions o = layout_options(make_corpus(), "");
  o.steps = 2;
  o.out_dir = fresh_dir("ddp");
  auto ddp = train_on(2, o);
  ASSERT_TRUE(ddp[0].ok()) << ddp[0].status().to_string();
  const model::ModelConfig c = *model::preset("tiny");
  const model::ParamLayout layout(c);
  const model::Units units(c, layout);
  int64_t largest_unit = 0;
  for (int u = 0; u < units.count(); ++u)
    largest_unit = std::max(largest_unit, units.range(u).size());
  for (int n : {2, 4}) {
    o.layout.dp_mode = DpMode::kFsdp;
    o.out_dir = fresh_dir("fsdp" + std::to_string(n));
    auto fsdp = train_on(n, o);
    ASSERT_TRUE(fsdp[0].ok()) << fsdp[0].status().to_string();
    const int64_t whole = ddp[0]->peak_state_bytes;
    // Each parameter's shard is padded to the most rows any rank holds (unit_shards.h).
    int64_t padding = 0;
    for (const model::ParamInfo& p : layout.params()) {
      const int64_t row = p.numel() / p.shape[0];
      padding += (shard_capacity(p.shape[0], n) * n - p.shape[0]) * row / n;
    }
    const int64_t f = int64_t(sizeof(float));
    const int64_t allowed = whole / n + 4 * padding * f + 4 * largest_unit * f;
    EXPECT_LE(fsdp[0]->peak_state_bytes, allowed)
        << "fsdp " << n << " peak " << fsdp[0]->peak_state_bytes << " vs ddp " << whole;
    EXPECT_LT(fsdp[0]->peak_state_bytes, whole);
    std::printf("tiny: DDP 2 holds %lld bytes of state per rank; FSDP %d at most %lld (%.2f)\n",
                static_cast<long long>(whole), n, static_cast<long long>(fsdp[0]->peak_state_bytes),
                double(fsdp[0]->peak_state_bytes) / double(whole));
  }
}

// A rank draws its initial weights part by part (set_params with a fill): the model every
// layout then holds is the one drawn whole, bit for bit, and a rank that shards its
// parameters never asks for more than one unit's part at a time, so it never holds the whole.
TEST(DataParallel, EachRankDrawsOnlyThePartsItKeeps) {
  const model::ModelConfig c = *model::preset("tiny");
  const model::ParamLayout layout(c);
  std::vector<float> whole(size_t(layout.total()));
  model::init_params(c, layout, 7, whole.data());
  const model::Units units(c, layout);
  int64_t largest_unit = 0;
  for (int u = 0; u < units.count(); ++u)
    largest_unit = std::max(largest_unit, units.range(u).size());
  struct Case {
    const char* name;
    int ranks;
    ParallelLayout layout;
  };
  const Case cases[] = {{"ddp 2", 2, {.dp_mode = DpMode::kDdp}},
                        {"fsdp 2", 2, {.dp_mode = DpMode::kFsdp}},
                        {"fsdp 2 ep 2", 2, {.dp_mode = DpMode::kFsdp, .ep = 2}},
                        {"fsdp 2 x pp 2", 4, {.dp_mode = DpMode::kFsdp, .pp = 2}},
                        {"zero1 tp 2", 2, {.dp_mode = DpMode::kZero1, .tp = 2}}};
  for (const Case& k : cases) {
    std::mutex mu;
    int64_t most = 0;
    run_data_parallel(k.ranks, c, k.layout, [&](DataParallel& dp) {
      int64_t asked = 0;
      dp.set_params([&](model::FlatRange r, float* out) {
        asked = std::max(asked, r.size());
        model::init_params(c, dp.layout(), 7, r.begin, r.end, out);
      });
      std::vector<float> gathered(whole.size());
      ASSERT_TRUE(dp.gather_model(gathered.data()).ok()) << k.name;
      EXPECT_EQ(std::memcmp(gathered.data(), whole.data(), whole.size() * sizeof(float)), 0)
          << k.name << ": rank " << dp.job_rank();
      std::lock_guard lock(mu);
      most = std::max(most, asked);
    });
    if (k.layout.dp_mode == DpMode::kFsdp) {
      EXPECT_LE(most, largest_unit) << k.name;
    }
  }
}

// What model-info plans per rank (state_bytes.h) is what every rank of the layout allocates:
// every mode, one and several data-parallel ranks, one and two stages, expert and tensor
// parallelism, tied embeddings (whose last stage keeps a replica of the embedding) and not.
TEST(StateBytes, PlannedPerRankIsWhatDataParallelHolds) {
  for (bool tied : {false, true}) {
    model::ModelConfig c = *model::preset("tiny");
    c.tie_embeddings = tied;
    for (DpMode mode : {DpMode::kDdp, DpMode::kZero1, DpMode::kZero2, DpMode::kFsdp}) {
      for (auto [dp, pp, ep, tp] : {std::tuple{1, 1, 1, 1},
                                    {3, 1, 1, 1},
                                    {1, 2, 1, 1},
                                    {2, 2, 1, 1},
                                    {2, 1, 2, 1},
                                    {4, 1, 2, 1},
                                    {2, 2, 2, 1},
                                    {1, 1, 1, 2},
                                    {2, 1, 1, 2},
                                    {1, 2, 1, 2},
                                    {2, 1, 2, 2}}) {
        const ParallelLayout layout{.dp_mode = mode, .dp = dp, .pp = pp, .tp = tp, .ep = ep};
        const std::vector<RankStateBytes> plan = *state_bytes_per_rank(c, layout);
        ASSERT_EQ(plan.size(), size_t(pp));
        const std::string what = std::string(dp_mode_name(mode)) + " dp " + std::to_string(dp) +
                                 " pp " + std::to_string(pp) + " ep " + std::to_string(ep) +
                                 " tp " + std::to_string(tp) + (tied ? " tied" : "");
        // Tensor parallelism divides every block's matrices.
        if (tp > 1) {
          const ParallelLayout no_tp{.dp_mode = mode, .dp = dp, .pp = pp};
          EXPECT_LT(plan[0].total(), (*state_bytes_per_rank(c, no_tp))[0].total()) << what;
        }
        // Expert parallelism divides what is kept whole; FSDP keeps nothing whole, and cutting
        // each expert over every rank or each rank's experts over their holders is the same.
        if (ep > 1) {
          const ParallelLayout no_ep{.dp_mode = mode, .dp = dp, .pp = pp};
          const uint64_t without = (*state_bytes_per_rank(c, no_ep))[0].total();
          if (mode == DpMode::kFsdp) {
            EXPECT_LE(plan[0].total(), without) << what;
          } else {
            EXPECT_LT(plan[0].total(), without) << what;
          }
        }
        testing::run_data_parallel(dp * pp * tp, c, layout, [&](DataParallel& d) {
          const RankStateBytes& p = plan[size_t(place_in(layout, d.job_rank()).stage)];
          std::vector<int> held = p.held.units;
          if (p.held.tied_replica) held.insert(held.begin(), 0);
          EXPECT_EQ(d.held_units(), held) << what << ", rank " << d.job_rank();
          EXPECT_EQ(uint64_t(d.state_bytes()), p.total()) << what << ", rank " << d.job_rank();
        });
      }
    }
  }
}

constexpr PipelineSchedule kSchedules[] = {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe,
                                           PipelineSchedule::kZeroBubble};

// most_in_flight's closed form is what the schedule's own ops keep: forwards whose backward
// has not finished (under ZB: whose W has not run), at their most.
TEST(Pipeline, MostInFlightIsWhatTheOpsKeep) {
  for (PipelineSchedule schedule : kSchedules) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 12; ++m) {
        const auto ops = pipeline_ops(schedule, p, m);
        for (int s = 0; s < p; ++s) {
          int in_flight = 0, most = 0;
          for (const PipeOp& op : ops[size_t(s)]) {
            if (op.pass == PipePass::kForward) ++in_flight;
            if (op.pass == PipePass::kBackward || op.pass == PipePass::kWeightGrads) --in_flight;
            most = std::max(most, in_flight);
          }
          EXPECT_EQ(most_in_flight(schedule, p, m, s), most)
              << pipeline_schedule_name(schedule) << " p " << p << " m " << m << " stage " << s;
        }
      }
    }
  }
}

// Every schedule runs each micro-batch's passes once on every stage, in their order: F, then
// the whole backward, or B then W.
TEST(Pipeline, EveryScheduleRunsEachPassOnceInOrder) {
  for (PipelineSchedule schedule : kSchedules) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 12; ++m) {
        const auto ops = pipeline_ops(schedule, p, m);
        ASSERT_EQ(ops.size(), size_t(p));
        for (int s = 0; s < p; ++s) {
          std::vector<std::string> seen(static_cast<size_t>(m));
          for (const PipeOp& op : ops[size_t(s)]) {
            ASSERT_TRUE(op.micro_batch >= 0 && op.micro_batch < m);
            seen[size_t(op.micro_batch)] += "FBbW"[int(op.pass)];
          }
          const std::string want = schedule == PipelineSchedule::kZeroBubble ? "FbW" : "FB";
          for (int mb = 0; mb < m; ++mb) {
            EXPECT_EQ(seen[size_t(mb)], want) << pipeline_schedule_name(schedule) << " p " << p
                                              << " m " << m << " stage " << s << " mb " << mb;
          }
        }
      }
    }
  }
}

// The printed timelines' bubbles: 1F1B and GPipe the theory's, ZB's W passes filling most of
// it (p = 2, m = 8: 1F1B 11.1%, ZB 4.0%).
TEST(Pipeline, ZeroBubbleIdlesLessThanOneFOneB) {
  const std::string one_f_one_b = print_schedule(PipelineSchedule::k1F1B, 2, 8);
  const std::string zb = print_schedule(PipelineSchedule::kZeroBubble, 2, 8);
  std::printf("%s%s", one_f_one_b.c_str(), zb.c_str());
  EXPECT_NE(one_f_one_b.find("bubble: 11.1%"), std::string::npos) << one_f_one_b;
  EXPECT_NE(zb.find("bubble: 4.0%"), std::string::npos) << zb;
  for (int p = 2; p <= 6; ++p) {
    for (int m = p; m <= 12; ++m) {
      const auto bubble = [](const std::string& text) {
        return std::stod(text.substr(text.find("bubble: ") + 8));
      };
      EXPECT_LT(bubble(print_schedule(PipelineSchedule::kZeroBubble, p, m)),
                bubble(print_schedule(PipelineSchedule::k1F1B, p, m)))
          << "p " << p << " m " << m;
    }
  }
}

// 1F1B keeps at most p - s micro-batches in flight on stage s, ZB p - s + 1, GPipe all m:
// with m >= 2p their activations must take less memory. Both stages are threads of this process, so
// what is measured is the job's: the peak of every live tensor during a step, less the model's
// state.
TEST(Pipeline, OneFOneBAndZeroBubbleHoldFewerActivationsThanGPipe) {
  const model::ModelConfig c = *model::preset("tiny");
  std::map<PipelineSchedule, int64_t> peak;
  for (PipelineSchedule schedule : kSchedules) {
    const ParallelLayout layout{.pp = 2, .schedule = schedule, .micro_batches = 8};
    Rng rng(3);
    train::Batch batch{16, 64, std::vector<int64_t>(16 * 64), std::vector<int64_t>(16 * 64)};
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
      batch.tokens[i] = int64_t(rng.below(320));
      batch.targets[i] = int64_t(rng.below(320));
    }
    std::atomic<int64_t> state{0};
    std::atomic<int> ready{0};
    std::atomic<bool> reset{false};
    testing::run_data_parallel(2, c, layout, [&](DataParallel& dp) {
      std::vector<float> full(size_t(dp.layout().total()));
      model::init_params(c, dp.layout(), 1, full.data());
      dp.set_params(full.data());
      // Once both stages are built, stage 0 resets the peak; then both run one step.
      ready++;
      while (ready.load() < 2) std::this_thread::yield();
      if (dp.job_rank() == 0) {
        reset_tensor_memory_peak();
        reset = true;
      }
      while (!reset.load()) std::this_thread::yield();
      auto r = run_pipeline_step(dp, batch, {.lr = 1e-3}, schedule);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      state += dp.step_comm().state_bytes;
    });
    peak[schedule] = tensor_memory_stats().peak_bytes - state.load();
    std::printf("%s: peak activations of the step %.2f MB\n",
                std::string(pipeline_schedule_name(schedule)).c_str(),
                double(peak[schedule]) / 1e6);
  }
  EXPECT_LT(peak[PipelineSchedule::k1F1B], peak[PipelineSchedule::kGPipe]);
  EXPECT_LT(peak[PipelineSchedule::kZeroBubble], peak[PipelineSchedule::kGPipe]);
}

}  // namespace
}  // namespace wl::parallel
