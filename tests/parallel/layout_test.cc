// Every data-parallel layout against one process: one step's gradients (the maths: every
// layout, tiny, a 4-layer small and a 4-layer tiny with Qwen3-MoE's q/k norms and a dense
// layer, f32 and bf16) and ten steps' loss curves. The heaviest tests
// of the suite (each trains every layout). Under ThreadSanitizer, which slows them about
// twentyfold, they run every layout's exchanges on tiny-sized models instead: one step's
// gradients in f32 on tied tiny (the tied replica's exchange) and a 4-layer tiny (pipelines of
// four stages), and three steps' loss curves on the 4-layer tiny.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "train_ranks.h"
#include "weightlift/core/random.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/parallel/pipeline/pipeline.h"

namespace wl::parallel {
namespace {

// Under a sanitizer the layouts run on tiny models, in f32, for few steps: memory and thread
// errors do not need small4's shapes or bf16's numbers to show, and at full size the
// families took 100-200 s each under AddressSanitizer on an AVX2 machine. The release build
// runs everything.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderSanitizer = true;
#else
constexpr bool kUnderSanitizer = false;
#endif

// The models, precisions and loss-curve length the tests run (see the top of the file).
std::vector<const char*> gradient_models() {
  if (kUnderSanitizer) return {"tiny_tied", "tiny4", "qwen4"};
  return {"tiny", "tiny_tied", "small4", "qwen4"};
}
std::vector<model::Precision> gradient_precisions() {
  if (kUnderSanitizer) return {model::Precision::kF32};
  return {model::Precision::kF32, model::Precision::kBF16};
}
std::vector<const char*> curve_models() {
  if (kUnderSanitizer) return {"tiny4"};
  return {"tiny", "small4"};
}
constexpr int kCurveSteps = kUnderSanitizer ? 3 : 10;

using testing::config_file;
using testing::fresh_dir;
using testing::kCurveTolerance;
using testing::kFirstStepTolerance;
using testing::layout_options;
using testing::make_corpus;
using testing::model_config;
using testing::read_lines;
using testing::read_weights;
using testing::run_data_parallel;
using testing::train_on;

// ---- every data-parallel layout computes the single process's maths --------------------------

// The largest |a - b| over every parameter, relative to the largest |b| of that parameter.
double max_relative_difference(const model::ParamLayout& layout, const std::vector<float>& a,
                               const std::vector<float>& b) {
  double worst = 0;
  for (const model::ParamInfo& p : layout.params()) {
    double scale = 0, diff = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
      scale = std::max(scale, double(std::fabs(b[size_t(i)])));
      diff = std::max(diff, double(std::fabs(a[size_t(i)] - b[size_t(i)])));
    }
    worst = std::max(worst, scale > 0 ? diff / scale : diff);
  }
  return worst;
}

double max_relative_difference(const std::string& a, const std::string& b) {
  auto x = read_weights(a), y = read_weights(b);
  EXPECT_EQ(x.size(), y.size());
  double worst = 0;
  for (const auto& [name, v] : x) {
    const std::vector<float>& w = y[name];
    double scale = 0, diff = 0;
    for (size_t i = 0; i < v.size() && i < w.size(); ++i) {
      scale = std::max(scale, double(std::fabs(w[i])));
      diff = std::max(diff, double(std::fabs(v[i] - w[i])));
    }
    worst = std::max(worst, scale > 0 ? diff / scale : diff);
  }
  return worst;
}

struct LayoutCase {
  const char* name;
  int ranks;
  ParallelLayout layout;  // dp is ranks / (pp x tp)
  int min_layers = 1;     // a model with fewer layers is not cut this way
};

// A global batch of random tokens, the same on every rank.
train::Batch random_batch(const model::ModelConfig& c, int64_t rows, int64_t seq) {
  Rng rng(11);
  train::Batch b{rows, seq, std::vector<int64_t>(size_t(rows * seq)),
                 std::vector<int64_t>(size_t(rows * seq))};
  for (size_t i = 0; i < b.tokens.size(); ++i) {
    b.tokens[i] = int64_t(rng.below(uint64_t(c.vocab_size)));
    b.targets[i] = i % 7 == 3 ? kernels::kIgnoreIndex : int64_t(rng.below(uint64_t(c.vocab_size)));
  }
  return b;
}

// One step's gradients in `layout` (summed over the ranks, the whole model on job rank 0) from
// init seed 5, gradient checkpointing on.
std::vector<float> one_step_gradients(int ranks, const model::ModelConfig& c,
                                      const ParallelLayout& layout, model::Precision precision) {
  const train::Batch batch = random_batch(c, 8, 32);
  const StepSettings settings{.precision = precision, .checkpointing = true};
  std::vector<float> out;
  run_data_parallel(ranks, c, layout, [&](DataParallel& dp) {
    std::vector<float> full(size_t(dp.layout().total()));
    model::init_params(c, dp.layout(), 5, full.data());
    dp.set_params(full.data());
    auto loss = layout.pp > 1 ? compute_pipeline_gradients(dp, batch, settings, layout.schedule)
                              : compute_gradients(dp, batch, settings);
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    std::vector<float> g(full.size());
    ASSERT_TRUE(dp.gather_model_grads(g.data()).ok());
    if (dp.job_rank() == 0) out = std::move(g);
  });
  return out;
}

// The largest per-parameter ||a - b|| / ||b||.
double max_relative_l2(const model::ParamLayout& layout, const std::vector<float>& a,
                       const std::vector<float>& b) {
  double worst = 0;
  for (const model::ParamInfo& p : layout.params()) {
    double diff = 0, norm = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
      const double d = double(a[size_t(i)]) - double(b[size_t(i)]);
      diff += d * d;
      norm += double(b[size_t(i)]) * double(b[size_t(i)]);
    }
    if (norm > 0) worst = std::max(worst, std::sqrt(diff / norm));
  }
  return worst;
}

// In f32 a layout's gradients differ from one process's only in the order sums are taken: a
// weight gradient over a micro-batch's tokens is its ranks' partial sums added together, not
// one GEMM's accumulation (relative error up to about tokens x 2^-24 of the largest term:
// 128 x 6e-8 = 8e-6 per element, far less typically), the embedding's rows likewise, the
// attention's key and value gradients in chunks that depend on the batch. 1e-5 of each
// tensor's largest gradient bounds it; the runs measure 2e-7 to 1.3e-6. A wrong sum, a
// missing rank, a micro-batch counted twice or an aux loss over the wrong tokens is off by
// far more.
constexpr double kGradientTolerance = 1e-5;
// bf16 mixed precision rounds every GEMM operand to bf16 (8 bits of mantissa), activations
// and activation gradients included. The last-bit differences above, in a value that sits
// near a bf16 rounding boundary, flip its rounding by 2^-8 relative, and the GEMMs that follow
// mix those flips into everything downstream: the layouts' bf16 gradients differ from one
// process's about as much as two bf16 roundings of the same gradient do. Measured: up to
// 4e-3 of a tensor's L2 norm (small4, 4 ranks); the bound is 1e-2, which a wrong sum or
// scaling (tens of percent) still fails.
constexpr double kBf16GradientTolerance = 1e-2;

// The layouts, in three families; each family is a test of its own, so that each stays well
// inside a test's time limit under the sanitizers and ctest can run them side by side.
using S = PipelineSchedule;
const LayoutCase kDataParallel[] = {
    {"ddp2", 2, {.dp_mode = DpMode::kDdp, .micro_batches = 2}},
    {"ddp4", 4, {.dp_mode = DpMode::kDdp, .micro_batches = 2}},
    {"zero1_2", 2, {.dp_mode = DpMode::kZero1, .micro_batches = 2}},
    {"zero2_2", 2, {.dp_mode = DpMode::kZero2, .micro_batches = 2}},
    {"fsdp2", 2, {.dp_mode = DpMode::kFsdp, .micro_batches = 2}},
    {"fsdp4", 4, {.dp_mode = DpMode::kFsdp, .micro_batches = 2}},
};
const LayoutCase kPipelines[] = {
    {"pp2_1f1b", 2, {.pp = 2, .schedule = S::k1F1B, .micro_batches = 4}},
    {"pp2_gpipe", 2, {.pp = 2, .schedule = S::kGPipe, .micro_batches = 4}},
    {"pp4_1f1b", 4, {.pp = 4, .schedule = S::k1F1B, .micro_batches = 4}, 4},
    {"pp4_gpipe", 4, {.pp = 4, .schedule = S::kGPipe, .micro_batches = 4}, 4},
    {"pp2_zb", 2, {.pp = 2, .schedule = S::kZeroBubble, .micro_batches = 4}},
    {"pp4_zb", 4, {.pp = 4, .schedule = S::kZeroBubble, .micro_batches = 4}, 4},
    {"ddp2_x_pp2", 4, {.dp_mode = DpMode::kDdp, .pp = 2, .micro_batches = 4}},
    {"ddp2_x_pp2_zb", 4, {.pp = 2, .schedule = S::kZeroBubble, .micro_batches = 4}},
    {"fsdp2_x_pp2", 4, {.dp_mode = DpMode::kFsdp, .pp = 2, .micro_batches = 4}},
};
const LayoutCase kExpertParallel[] = {
    {"ep2", 2, {.ep = 2, .micro_batches = 2}},
    {"ep4", 4, {.ep = 4, .micro_batches = 2}},
    {"ddp2_x_ep2", 4, {.ep = 2, .micro_batches = 2}},
    {"fsdp2_ep2", 2, {.dp_mode = DpMode::kFsdp, .ep = 2, .micro_batches = 2}},
    // Four ranks, two expert groups: each run of experts is held, sharded and summed by the
    // two ranks that run it.
    {"fsdp2_x_ep2", 4, {.dp_mode = DpMode::kFsdp, .ep = 2, .micro_batches = 2}},
    {"zero1_2_x_ep2", 4, {.dp_mode = DpMode::kZero1, .ep = 2, .micro_batches = 2}},
    // Two stages of four data-parallel ranks each, two expert groups of two in each stage.
    {"ddp2_x_ep2_x_pp2", 8, {.pp = 2, .ep = 2, .micro_batches = 2}},
};

// Tensor parallelism: on tiny (one kv head) every TP rank holds the kv head; on tiny_gqa a
// TP of 2 splits the two kv heads and a TP of 4 shares each with a pair of ranks.
const LayoutCase kTensorParallel[] = {
    {"tp2", 2, {.tp = 2, .micro_batches = 2}},
    {"tp4", 4, {.tp = 4, .micro_batches = 2}},
    {"ddp2_x_tp2", 4, {.tp = 2, .micro_batches = 2}},
    {"zero1_2_x_tp2", 4, {.dp_mode = DpMode::kZero1, .tp = 2, .micro_batches = 2}},
    {"fsdp2_x_tp2", 4, {.dp_mode = DpMode::kFsdp, .tp = 2, .micro_batches = 2}},
    {"tp2_x_pp2", 4, {.pp = 2, .tp = 2, .micro_batches = 4}},
    // Megatron's composition: attention split by heads over the TP pair, each layer's experts
    // over the two expert-parallel ranks of each TP rank (and each expert's ffn rows over the
    // TP pair); then four data-parallel ranks, two expert groups per TP rank.
    {"tp2_x_ep2", 4, {.tp = 2, .ep = 2, .micro_batches = 2}},
    {"tp2_x_ep2_x_ddp2", 8, {.tp = 2, .ep = 2, .micro_batches = 2}},
};

std::span<const LayoutCase> family(const std::string& name) {
  if (name == "data_parallel") return kDataParallel;
  if (name == "pipelines") return kPipelines;
  if (name == "tensor_parallel") return kTensorParallel;
  return kExpertParallel;
}

// The models a family's gradients are checked on: tensor parallelism adds tiny_gqa.
std::vector<const char*> gradient_models(const std::string& family) {
  std::vector<const char*> out = gradient_models();
  if (family == "tensor_parallel") out.push_back("tiny_gqa");
  return out;
}

// Every rank's own gradients after one step in `layout` (as one_step_gradients()).
std::vector<std::vector<float>> each_ranks_gradients(int ranks, const model::ModelConfig& c,
                                                     const ParallelLayout& layout,
                                                     bool checkpointing) {
  const train::Batch batch = random_batch(c, 8, 32);
  const StepSettings settings{.checkpointing = checkpointing};
  std::vector<std::vector<float>> out(static_cast<size_t>(ranks));
  run_data_parallel(ranks, c, layout, [&](DataParallel& dp) {
    std::vector<float> full(size_t(dp.layout().total()));
    model::init_params(c, dp.layout(), 5, full.data());
    dp.set_params(full.data());
    auto loss = compute_pipeline_gradients(dp, batch, settings, layout.schedule);
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    const std::span<const float> mine = dp.local_grads();
    out[size_t(dp.job_rank())].assign(mine.begin(), mine.end());
  });
  return out;
}

// ZB runs the same GEMMs as 1F1B, each weight gradient later, on the same tensors: every
// rank's gradients are equal bit for bit. With tensor parallelism too (tiny's one kv head is
// shared by both TP ranks, whose non-leader zeroes its copy of the kv gradient after the
// weight gradient has read it), and expert parallelism (the weight gradients of the rows the
// exchange brought), with gradient checkpointing on and off.
TEST(Pipelines, ZeroBubbleGradientsAreOneFOneBsBitForBit) {
  const model::ModelConfig c = model_config("tiny");
  const LayoutCase cases[] = {
      {"pp2", 2, {.pp = 2, .micro_batches = 4}},
      {"tp2_x_pp2", 4, {.pp = 2, .tp = 2, .micro_batches = 4}},
      {"ep2_x_pp2", 4, {.pp = 2, .ep = 2, .micro_batches = 2}},
  };
  for (const LayoutCase& lc : cases) {
    for (const bool checkpointing : {false, true}) {
      ParallelLayout zb = lc.layout;
      zb.schedule = S::kZeroBubble;
      const auto a = each_ranks_gradients(lc.ranks, c, lc.layout, checkpointing);
      const auto b = each_ranks_gradients(lc.ranks, c, zb, checkpointing);
      for (int r = 0; r < lc.ranks; ++r) {
        const std::vector<float>&x = a[size_t(r)], &y = b[size_t(r)];
        ASSERT_TRUE(!x.empty() && x.size() == y.size()) << lc.name << " rank " << r;
        EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0)
            << lc.name << " rank " << r << (checkpointing ? " checkpointing" : "");
      }
    }
  }
}

class Layouts : public ::testing::TestWithParam<const char*> {};

// Every layout against one process's reference, computed once per model, precision and
// micro-batch count (the aux loss is a micro-batch's).
TEST_P(Layouts, OneStepGradientsAreTheSingleProcesses) {
  for (const char* name : gradient_models(GetParam())) {
    const model::ModelConfig c = model_config(name);
    const model::ParamLayout layout(c);
    for (model::Precision p : gradient_precisions()) {
      std::map<int, std::vector<float>> refs;
      for (const LayoutCase& lc : family(GetParam())) {
        if (c.num_layers < lc.min_layers) continue;
        const int M = lc.layout.micro_batches;
        if (!refs.count(M)) refs[M] = one_step_gradients(1, c, {.micro_batches = M}, p);
        const std::vector<float>& ref = refs[M];
        const std::vector<float> got = one_step_gradients(lc.ranks, c, lc.layout, p);
        ASSERT_EQ(got.size(), ref.size());
        if (p == model::Precision::kF32) {
          const double diff = max_relative_difference(layout, got, ref);
          std::printf("%s %s f32: gradients within %.2g of one process's (largest element)\n",
                      lc.name, name, diff);
          EXPECT_LE(diff, kGradientTolerance) << lc.name << " " << name;
        } else {
          const double diff = max_relative_l2(layout, got, ref);
          std::printf("%s %s bf16: gradients within %.2g of one process's (L2, worst tensor)\n",
                      lc.name, name, diff);
          EXPECT_LE(diff, kBf16GradientTolerance) << lc.name << " " << name;
        }
      }
    }
  }
}

// Tensor parallelism's first step in bf16. Its ranks add a block's partial products in
// another order than one process's GEMM does (1e-7 relative in f32), and a bf16 rounding of an
// operand near a boundary turns such a difference into 2^-8 of that element: measured on
// small4, step 1's aux loss within 1.4e-4 and gradient norm within 6e-4 of one process's, over
// the 1e-4 that the other layouts meet in bf16 (their ranks compute each row as one process
// does). In f32 tensor parallelism meets 1e-4 too, and is held to it.
constexpr double kTensorParallelBf16FirstStepTolerance = 2e-3;

TEST_P(Layouts, TenStepLossCurvesFollowTheSingleProcess) {
  const std::string corpus = make_corpus(), dir = fresh_dir("configs");
  const bool tensor_parallel = std::string(GetParam()) == "tensor_parallel";
  // The curves run in bf16; tensor parallelism's in f32 as well (see above).
  std::vector<model::Precision> precisions = {model::Precision::kBF16};
  if (tensor_parallel) precisions.insert(precisions.begin(), model::Precision::kF32);
  for (const model::Precision precision : precisions) {
    const bool f32 = precision == model::Precision::kF32;
    const double first_step_tolerance =
        tensor_parallel && !f32 ? kTensorParallelBf16FirstStepTolerance : kFirstStepTolerance;
    for (const char* name : curve_models()) {
      const std::string config = std::string(name) == "tiny" ? "" : config_file(dir, name);
      std::map<int, std::vector<std::string>> refs;  // by micro-batches
      std::map<int, std::string> ref_dirs;
      const std::string run = std::string(name) + (f32 ? "_f32" : "_bf16");
      for (const LayoutCase& lc : family(GetParam())) {
        if (model_config(name).num_layers < lc.min_layers) continue;
        const int M = lc.layout.micro_batches;
        if (!refs.count(M)) {
          TrainOptions one = layout_options(corpus, config);
          one.steps = kCurveSteps;
          one.precision = precision;
          one.layout.micro_batches = M;
          one.out_dir = fresh_dir(run + "_one_" + std::to_string(M));
          ASSERT_TRUE(train_on(1, one)[0].ok());
          refs[M] = read_lines(one.out_dir + "/metrics.jsonl");
          ref_dirs[M] = one.out_dir;
        }
        const std::vector<std::string>& theirs = refs[M];
        TrainOptions o = layout_options(corpus, config);
        o.steps = kCurveSteps;
        o.precision = precision;
        o.layout = lc.layout;
        o.out_dir = fresh_dir(run + "_" + lc.name);
        for (auto& r : train_on(lc.ranks, o)) ASSERT_TRUE(r.ok()) << r.status().to_string();
        const std::vector<std::string> mine = read_lines(o.out_dir + "/metrics.jsonl");
        ASSERT_EQ(mine.size(), theirs.size());
        for (size_t i = 0; i < mine.size(); ++i) {
          const auto a = nlohmann::json::parse(mine[i]), b = nlohmann::json::parse(theirs[i]);
          const double tol = i == 0 ? first_step_tolerance : kCurveTolerance;
          std::vector<const char*> keys = {"ce", "loss"};
          if (i == 0) keys.insert(keys.end(), {"aux", "grad_norm"});
          for (const char* key : keys) {
            EXPECT_NEAR(a[key].get<double>(), b[key].get<double>(), tol * b[key].get<double>())
                << key << " at step " << i + 1 << " of " << lc.name << " on " << run;
          }
        }
        const double weights = max_relative_difference(o.out_dir + "/model.safetensors",
                                                       ref_dirs[M] + "/model.safetensors");
        std::printf("%s %s %s, %d steps: weights within %.2g of one process's\n", lc.name, name,
                    f32 ? "f32" : "bf16", kCurveSteps, weights);
        // A pipeline alone runs every micro-batch's rows through the same kernels one process
        // does, in the same order: the same bits, every step on.
        if (lc.ranks == lc.layout.pp) {
          EXPECT_EQ(weights, 0.0) << lc.name << " on " << run;
        }
      }
    }
  }
}

// One step of `layout` on `ranks` ranks from init seed 5: the model's whole gradients and the
// loss, as rank 0 sees them.
struct FirstStep {
  std::vector<float> grads;
  model::LossTerms loss;
};
FirstStep first_step(int ranks, const model::ModelConfig& c, const ParallelLayout& layout,
                     const train::Batch& batch) {
  FirstStep out;
  run_data_parallel(ranks, c, layout, [&](DataParallel& dp) {
    std::vector<float> full(size_t(dp.layout().total()));
    model::init_params(c, dp.layout(), 5, full.data());
    dp.set_params(full.data());
    auto loss = layout.pp > 1 ? compute_pipeline_gradients(dp, batch, {}, layout.schedule)
                              : compute_gradients(dp, batch, {});
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    std::vector<float> g(full.size());
    ASSERT_TRUE(dp.gather_model_grads(g.data()).ok());
    if (dp.job_rank() == 0) out = {std::move(g), *loss};
  });
  return out;
}

// Token dropping is per rank and per micro-batch (docs/algorithms.md): a layout whose ranks
// route the tokens their data-parallel twin routes drops the same slots and gives its
// gradients. Expert parallelism drops among a rank's own tokens before the exchange, as DDP's
// rank does, and dispatches in fixed-size blocks (expert_rows.cc); tensor-parallel ranks and
// pipeline stages route one process's micro-batches.
TEST(TokenDropping, EveryLayoutDropsWhatItsDataParallelTwinDrops) {
  model::ModelConfig c = model_config("tiny4");
  c.capacity_factor = 0.75;
  const model::ParamLayout params(c);
  struct Twin {
    const char* name;
    int ranks;
    ParallelLayout layout;
    int twin_ranks;
    ParallelLayout twin;
  };
  const Twin twins[] = {
      {"ep2", 2, {.ep = 2, .micro_batches = 2}, 2, {.micro_batches = 2}},
      {"ddp2_x_ep2", 4, {.ep = 2, .micro_batches = 2}, 4, {.micro_batches = 2}},
      {"tp2", 2, {.tp = 2, .micro_batches = 2}, 1, {.micro_batches = 2}},
      {"tp2_x_ep2", 4, {.tp = 2, .ep = 2, .micro_batches = 2}, 2, {.micro_batches = 2}},
      {"pp2", 2, {.pp = 2, .micro_batches = 4}, 1, {.micro_batches = 4}},
  };
  const train::Batch batch = random_batch(c, 8, 32);
  for (const Twin& t : twins) {
    const FirstStep got = first_step(t.ranks, c, t.layout, batch);
    const FirstStep want = first_step(t.twin_ranks, c, t.twin, batch);
    ASSERT_GT(want.loss.dropped, 0) << t.name << ": a twin that drops nothing tests nothing";
    EXPECT_EQ(got.loss.slots, want.loss.slots) << t.name;
    EXPECT_EQ(got.loss.dropped, want.loss.dropped) << t.name;
    ASSERT_EQ(got.grads.size(), want.grads.size()) << t.name;
    const double diff = max_relative_difference(params, got.grads, want.grads);
    std::printf("%s: %ld of %ld slots dropped, gradients within %.2g of its twin's\n", t.name,
                long(got.loss.dropped), long(got.loss.slots), diff);
    EXPECT_LE(diff, kGradientTolerance) << t.name;
  }
}

// A model with dense layers (Qwen3-MoE's mlp_only_layers): the aux and z losses are the mean
// over the layers that route, and a stage without the head reports its layers' share weighed
// as one process weighs them, so a pipeline's losses are one process's.
TEST(Pipeline, StagesWithDenseLayersReportOneProcesssRouterLosses) {
  model::ModelConfig c = model_config("tiny4");
  c.dense_layers = {0, 2};
  c.dense_ffn_dim = 2 * c.hidden_size;
  ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
  const train::Batch batch = random_batch(c, 4, 16);
  const model::LossTerms want = first_step(1, c, {.micro_batches = 2}, batch).loss;
  const model::LossTerms got = first_step(2, c, {.pp = 2, .micro_batches = 2}, batch).loss;
  ASSERT_GT(want.aux, 0);
  EXPECT_NEAR(got.aux, want.aux, 1e-6 * want.aux);
  EXPECT_NEAR(got.z, want.z, 1e-6 * want.z);
  EXPECT_NEAR(got.ce, want.ce, 1e-6 * want.ce);
  EXPECT_EQ(got.slots, want.slots);
}

INSTANTIATE_TEST_SUITE_P(Families, Layouts,
                         ::testing::Values("data_parallel", "pipelines", "expert_parallel",
                                           "tensor_parallel"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace wl::parallel
