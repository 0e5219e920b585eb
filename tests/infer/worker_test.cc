// The inference worker against the trainer's model (model::Transformer, f32), on fixed
// prompts: logits at every prompt position, each decode step's logits, and greedy generations,
// at TP 1 and 2 (thread-ranks on a MemoryStore world), bf16 and fp8, on `tiny` and on a
// 2-layer `small` (fp8 blocks there are partial in both directions and several per matrix).
// The weights come from the scalar reference transform (transfer/layout/reference_transform.h), and
// in the last test by a real p2p update into receivers, read through a ReadGuard.
//
// Two comparisons each, so that a bug cannot hide inside a loose tolerance:
//   tight  against the trainer run on the weights the worker effectively uses (bf16-rounded;
//          fp8 dequantized and un-fused), where only f32 reassociation separates the two;
//   loose  against the trainer on the original f32 weights, within the format's bound.
#include "weightlift/infer/worker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "../transfer/fixture.h"
#include "reference_tensors.h"
#include "run_worker.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/core/parallel.h"
#include "weightlift/infer/dequant_linear.h"
#include "weightlift/model/generate.h"
#include "weightlift/model/transformer.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "weightlift/transfer/modes/update_executor.h"
#include "weightlift/transfer/plan/plan_transfer.h"
#include "worker_fixture.h"

namespace wl::infer {
namespace {

using namespace wl::infer::testing;  // worker_fixture.h

using transfer::LayoutOptions;
using transfer::WeightFormat;

// ---- tolerances ---------------------------------------------------------------------------
// Errors are per position (a prompt position or a decode step): the max |worker - trainer|
// over the V logits, measured in units of u S, with S = max |logit| of the trainer over the
// prompts (about 30 with these weights) and u the unit roundoff of the weight format (each
// weight w is held as w (1 + e), |e| <= u). Every logit ends a chain of about 3L + 2 matrix
// products (qkv, o, gate_up and down per block, the head), each adding relative noise of
// about u / sqrt(3) to its outputs, in quadrature; so a typical position should err by about
// one u S, and the medians are within a factor of two of that.
//
// The tail is another matter, and it is MoE's: a token whose k-th and (k+1)-th experts are
// nearly tied in the router can switch experts under any rounding, and then its output moves
// by O(1), not O(u). So the bounds are on the median and the 90th percentile, where rounding
// rules; the maximum is reported, not bounded. Measured over prompt positions and decode
// steps (tiny and small-2, TP 1 and 2; the tests print them), and the bounds:
//
//              median          p90             max (reported)        bound: median / p90
//   bf16       1.9 - 2.3 u S   3.0 - 3.8 u S   27 - 146 u S          3 / 6 u S
//   fp8        0.4 - 0.6 u S   0.9 - 1.2 u S   4.5 - 8.9 u S         1 / 2 u S
//
// (S is about 30, so the medians are about 0.12 logits in bf16 and 0.7 to 1.1 in fp8, whose u
// is 32 times bf16's.) Greedy decoding agrees with the trainer's argmax at
// 94-95 of 96 steps in bf16 and 89-94 of 96 in fp8 (bounds: 90% and 80%), the misses at near
// ties or routing flips. What pins the worker down exactly is the other comparison: against
// the trainer on the weights the worker effectively holds, every logit of every position and
// step agrees to kReassociation and greedy agrees at every step.
constexpr double kBf16U = 0x1.0p-9;  // bf16: 8 significant bits, round to nearest
constexpr double kFp8U = 0x1.0p-4;   // e4m3: 4 significant bits (normal range of the block)
struct Bounds {
  double u, median, p90;  // the last two in units of u S
  double min_agree;       // share of greedy steps whose token is the trainer's argmax
};
constexpr Bounds kBf16Bounds{kBf16U, 3.0, 6.0, 0.9};
constexpr Bounds kFp8Bounds{kFp8U, 1.0, 2.0, 0.8};
const Bounds& bounds_for(WeightFormat f) {
  return f == WeightFormat::kBF16 ? kBf16Bounds : kFp8Bounds;
}

// ---- weights and prompts --------------------------------------------------------------------

std::unique_ptr<model::Transformer> trainer_with(const model::ModelConfig& c,
                                                 const std::vector<float>& w) {
  auto m = std::make_unique<model::Transformer>(c);
  std::memcpy(m->params().data<float>(), w.data(), w.size() * 4);
  return m;
}

// The trainer's logits [T, V] at every position of `tokens` (batch 1).
std::vector<float> trainer_logits(model::Transformer& m, const std::vector<int64_t>& tokens) {
  const int64_t T = int64_t(tokens.size());
  std::vector<int64_t> targets(tokens.size(), -100);
  std::vector<float> logits(size_t(T * m.config().vocab_size));
  m.evaluate(tokens.data(), targets.data(), 1, T, {.logits_out = logits.data()});
  return logits;
}

// The f32 weights a TP-1 worker effectively computes with: every receiver tensor dequantized
// (bf16 widened; fp8 q * scale) and put back where its source slices came from (un-fusing
// qkv and gate_up). At TP 1 every parameter element is covered exactly once.
std::vector<float> effective_weights(const model::ModelConfig& c, WeightFormat format,
                                     const std::map<std::string, Tensor>& held) {
  const LayoutOptions o{.tp = 1, .format = format};
  auto layout = transfer::inference_layout(c, o);
  WL_CHECK(layout.ok());
  const model::ParamLayout params(c);
  std::vector<float> w(size_t(params.total()), std::nanf(""));
  for (const transfer::ReceiverTensor& t : *layout) {
    if (!t.scale_of.empty()) continue;
    const Tensor& x = held.at(t.name);
    WeightMatrix m{.dtype = x.dtype(), .data = x.raw(), .rows = t.rows, .cols = t.cols};
    if (t.quantized()) m.scale = held.at(t.scale).data<float>();
    std::vector<float> deq(size_t(t.rows * t.cols));
    dequantize_rows(m, 0, t.rows, deq.data());
    for (const transfer::SourceSlice& s : t.sources) {
      const model::ParamInfo& p = params.at(s.param);
      const int64_t pcols = p.shape.size() == 2 ? p.shape[1] : 1;
      for (int64_t i = 0; i < s.rows(); ++i) {
        std::memcpy(w.data() + p.offset + (s.row_begin + i) * pcols + s.col_begin,
                    deq.data() + (s.dst_row + i) * t.cols, size_t(s.col_end - s.col_begin) * 4);
      }
    }
  }
  for (float v : w) WL_CHECK(!std::isnan(v)) << "a parameter element no receiver tensor covers";
  return w;
}

// ---- comparisons ----------------------------------------------------------------------------

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

// The trainer's logits for every prompt, concatenated, and their scale S.
struct TrainerRun {
  std::vector<std::vector<float>> logits;  // per prompt, [T, V]
  double scale = 0;
};

TrainerRun run_trainer(model::Transformer& m) {
  TrainerRun t;
  for (const auto& p : prompts()) {
    t.logits.push_back(trainer_logits(m, p));
    t.scale = std::max(t.scale, max_abs(t.logits.back()));
  }
  return t;
}

// Per prompt position, max |worker - trainer| over the vocabulary.
std::vector<double> prompt_errors(const RankOutput& o, const TrainerRun& t, int64_t V) {
  std::vector<double> out;
  for (size_t r = 0; r < prompts().size(); ++r) {
    const Tensor& got = o.prompt_logits[r];
    EXPECT_EQ(size_t(got.numel()), t.logits[r].size());
    for (size_t p = 0; p < t.logits[r].size() / size_t(V); ++p) {
      double e = 0;
      for (size_t i = p * size_t(V); i < (p + 1) * size_t(V); ++i) {
        e = std::max(e, double(std::fabs(got.data<float>()[i] - t.logits[r][i])));
      }
      out.push_back(e);
    }
  }
  return out;
}

struct Quantiles {
  double median = 0, p90 = 0, max = 0;
};
Quantiles quantiles(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[v.size() * 9 / 10], v.back()};
}

// Greedy agreement. For each row and step, the trainer's logits for the worker's own prefix
// (which also gives each decode step's logit error: the KV-cache path against the trainer's
// full recompute). A step is a near tie when the trainer's top-2 margin is at most 2 * tol:
// with every logit within tol, only such a step can legitimately pick another token. A step
// is in the tail when its error exceeds tol (an MoE routing flip; see the tolerances). Counts
// steps whose token is the trainer's argmax, and per row the leading tokens equal to
// model::generate's own greedy ones.
struct GreedyCheck {
  int64_t steps = 0, agree = 0, near_ties = 0, tail = 0;
  // Disagreements at a step neither a near tie nor in the tail: impossible unless a token is
  // not the argmax of the logits recorded with it (a consistency check of the generation).
  int64_t unexplained = 0;
  int64_t same_prefix = 0;     // summed over rows: tokens equal to model::generate's, leading
  std::vector<double> errors;  // per step
};

GreedyCheck check_greedy(model::Transformer& m, const Generation& g, double tol) {
  const int64_t V = m.config().vocab_size;
  auto reference =
      model::generate(m, prompts(), {.max_new_tokens = kNewTokens, .sampling = {.temperature = 0}});
  EXPECT_TRUE(reference.ok()) << reference.status().to_string();
  GreedyCheck c;
  for (size_t r = 0; r < prompts().size(); ++r) {
    std::vector<int64_t> seq = prompts()[r];
    seq.insert(seq.end(), g.tokens[r].begin(), g.tokens[r].end());
    const std::vector<float> logits = trainer_logits(m, seq);
    bool same = reference.ok();
    for (size_t s = 0; s < g.tokens[r].size(); ++s) {
      const float* want = logits.data() + (prompts()[r].size() - 1 + s) * size_t(V);
      const std::vector<float>& got = g.logits[r][s];
      double e = 0;
      for (int64_t v = 0; v < V; ++v) e = std::max(e, double(std::fabs(got[size_t(v)] - want[v])));
      c.errors.push_back(e);
      std::vector<float> sorted(want, want + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      const bool tie = sorted[0] - sorted[1] <= 2 * tol, tail = e > tol;
      const bool agree = g.tokens[r][s] == kernels::argmax(want, V);
      ++c.steps;
      c.agree += agree;
      c.near_ties += tie;
      c.tail += tail && !tie;
      c.unexplained += !agree && !tie && !tail;
      same = same && g.tokens[r][s] == reference->tokens[r][s];
      c.same_prefix += same;
    }
  }
  return c;
}

// Prompt and decode errors against the f32 trainer within the format's bounds, and greedy
// agreement. Returns the quantiles (in units of u S) and the greedy counts for the report.
struct LooseResult {
  Quantiles q;
  GreedyCheck greedy;
};
LooseResult check_against_f32(model::Transformer& trainer, const RankOutput& o,
                              WeightFormat format) {
  const Bounds& b = bounds_for(format);
  const TrainerRun run = run_trainer(trainer);
  const double uS = b.u * run.scale;
  std::vector<double> errors = prompt_errors(o, run, trainer.config().vocab_size);
  LooseResult r;
  r.greedy = check_greedy(trainer, o.gen, b.p90 * uS);
  errors.insert(errors.end(), r.greedy.errors.begin(), r.greedy.errors.end());
  r.q = quantiles(errors);
  r.q = {r.q.median / uS, r.q.p90 / uS, r.q.max / uS};
  EXPECT_LE(r.q.median, b.median) << "median position error, in u S";
  EXPECT_LE(r.q.p90, b.p90) << "90th percentile position error, in u S";
  EXPECT_EQ(r.greedy.unexplained, 0);
  EXPECT_GE(double(r.greedy.agree), b.min_agree * double(r.greedy.steps))
      << "greedy tokens equal to the trainer's argmax";
  return r;
}

void check_case(const std::string& preset, WeightFormat format, int tp,
                int64_t page_tokens = WorkerOptions{}.kv_page_tokens) {
  OneComputeThread one;
  const std::string name = preset + " " + std::string(transfer::weight_format_name(format)) +
                           " tp" + std::to_string(tp) + " pages of " + std::to_string(page_tokens);
  SCOPED_TRACE(name);
  const model::ModelConfig c = config_named(preset);
  const std::vector<float> w = test_weights(c, 42);
  const std::vector<RankOutput> out = run_worker(c, w, format, tp, page_tokens);
  if (::testing::Test::HasFatalFailure()) return;

  // Every TP rank ends with the same logits bit for bit (x is replicated after each allreduce,
  // the head is replicated), so the ranks pick the same tokens without talking.
  for (int r = 1; r < tp; ++r) {
    EXPECT_EQ(out[size_t(r)].gen.tokens, out[0].gen.tokens);
    for (size_t p = 0; p < prompts().size(); ++p) {
      EXPECT_EQ(std::memcmp(out[size_t(r)].prompt_logits[p].raw(), out[0].prompt_logits[p].raw(),
                            out[0].prompt_logits[p].nbytes()),
                0)
          << "rank " << r;
    }
  }

  // Loose: against the trainer's f32 model.
  auto f32_trainer = trainer_with(c, w);
  const LooseResult loose = check_against_f32(*f32_trainer, out[0], format);

  // Tight: against the trainer on the weights the worker effectively uses, every logit. bf16
  // rounding is element-wise, so any TP degree computes with the same effective weights; fp8
  // blocks depend on the TP shard (and replicated kv heads are quantized differently per
  // rank), so the fp8 tight check runs at TP 1, where un-fusing is exact. Here greedy must
  // agree at every step of every row.
  double tight = std::nan("");  // not run: fp8 at TP 2
  if (format == WeightFormat::kBF16 || tp == 1) {
    std::vector<float> eff = w;
    if (format == WeightFormat::kBF16) {
      round_through(DType::kBF16, eff.data(), eff.data(), eff.size());
    } else {
      eff = effective_weights(
          c, format,
          tensors_of(transfer::reference_receiver_tensors(c, {.tp = 1, .format = format}, w)));
    }
    auto eff_trainer = trainer_with(c, eff);
    const TrainerRun eff_run = run_trainer(*eff_trainer);
    const double tol = kReassociation * eff_run.scale;
    const GreedyCheck exact = check_greedy(*eff_trainer, out[0].gen, tol);
    std::vector<double> errors = prompt_errors(out[0], eff_run, c.vocab_size);
    errors.insert(errors.end(), exact.errors.begin(), exact.errors.end());
    tight = quantiles(errors).max / eff_run.scale;
    EXPECT_LE(tight, kReassociation);
    // Token for token: every step the trainer's argmax, every row model::generate's tokens.
    EXPECT_EQ(exact.agree, exact.steps);
    EXPECT_EQ(exact.same_prefix, exact.steps);
  }
  const GreedyCheck& gr = loose.greedy;
  char tight_text[40] = "not run (fp8 at TP 2)";
  if (!std::isnan(tight)) std::snprintf(tight_text, sizeof tight_text, "max %.2g S", tight);
  std::printf(
      "[measured] %-16s vs f32 weights: median %.2f p90 %.2f max %.1f u S; greedy "
      "agrees %lld of %lld steps (near ties %lld, tail %lld), leading tokens equal to "
      "the trainer's generation %lld; vs effective weights: %s\n",
      name.c_str(), loose.q.median, loose.q.p90, loose.q.max, (long long)gr.agree,
      (long long)gr.steps, (long long)gr.near_ties, (long long)gr.tail, (long long)gr.same_prefix,
      tight_text);
}

TEST(InferenceWorker, TinyBf16Tp1And2MatchTheTrainer) {
  check_case("tiny", WeightFormat::kBF16, 1);
  check_case("tiny", WeightFormat::kBF16, 2);
}

// Pages of 5 tokens (the default holds every prompt in one): each prompt and each row's own
// tokens over several pages, attended as one sequence.
TEST(InferenceWorker, TinyBf16InPagesOfFiveTokensMatchesTheTrainer) {
  check_case("tiny", WeightFormat::kBF16, 1, 5);
  check_case("tiny", WeightFormat::kBF16, 2, 5);
}

TEST(InferenceWorker, TinyFp8Tp1And2MatchTheTrainer) {
  check_case("tiny", WeightFormat::kFP8, 1);
  check_case("tiny", WeightFormat::kFP8, 2);
}

TEST(InferenceWorker, SmallTwoLayersBf16AndFp8Tp1And2MatchTheTrainer) {
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
    for (int tp : {1, 2}) check_case("small-2", f, tp);
  }
}

// q/k norms and dense layers (Qwen3-MoE's), and a model of dense layers only (Llama's), in both
// formats and split over two ranks (the dense MLP's rows as an expert's, the norms whole).
TEST(InferenceWorker, HuggingFaceFamiliesMatchTheTrainer) {
  for (const char* family : {"tiny-qwen3-moe", "tiny-llama"}) {
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
      for (int tp : {1, 2}) check_case(family, f, tp);
    }
  }
}

// Routing replay's first half: the experts a worker records for every token it feeds (the
// prompt, then each new token but the last) are the ones its router chose, which the trainer's
// router on the same (bf16-rounded) weights chooses too, except where two experts are so
// nearly tied that f32 reassociation flips them; and a trainer that replays them routes every
// token exactly so, and computes logits within reassociation of the worker's at every step.
TEST(InferenceWorker, RecordsTheExpertsOfEveryTokenItFeeds) {
  OneComputeThread one;
  const model::ModelConfig c = config_named("small-2");
  const std::vector<float> w = test_weights(c, 21);
  const auto held = tensors_of(transfer::reference_receiver_tensors(c, {.tp = 1}, w));
  auto worker = InferenceWorker::create({.config = c, .layout = {.tp = 1}});
  ASSERT_TRUE(worker.ok()) << worker.status().to_string();
  auto bound = (*worker)->bind(lookup_in(held));
  ASSERT_TRUE(bound.ok());
  auto gen = (*worker)->generate(*bound, prompts(),
                                 {.max_new_tokens = 12, .keep_logits = true, .keep_routes = true});
  ASSERT_TRUE(gen.ok()) << gen.status().to_string();
  auto trainer = trainer_with(c, effective_weights(c, WeightFormat::kBF16, held));
  const int64_t width = c.num_layers * c.top_k, V = c.vocab_size;
  int64_t token_layers = 0, same = 0;
  for (size_t r = 0; r < prompts().size(); ++r) {
    std::vector<int64_t> fed = prompts()[r];
    fed.insert(fed.end(), gen->tokens[r].begin(), gen->tokens[r].end() - 1);
    const int64_t T = int64_t(fed.size());
    const std::vector<int32_t>& routes = gen->routes[r];
    ASSERT_EQ(int64_t(routes.size()), T * width) << "row " << r;
    std::vector<int64_t> targets(fed.size(), -100);
    std::vector<int32_t> own(routes.size()), replayed(routes.size());
    std::vector<float> logits(size_t(T * V));
    trainer->evaluate(fed.data(), targets.data(), 1, T, {.routes_out = own.data()});
    for (int64_t e = 0; e < T * width; e += c.top_k) {
      std::vector<int32_t> a(own.begin() + e, own.begin() + e + c.top_k);
      std::vector<int32_t> b(routes.begin() + e, routes.begin() + e + c.top_k);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      ++token_layers;
      same += a == b;
    }
    trainer->evaluate(fed.data(), targets.data(), 1, T,
                      {.logits_out = logits.data(),
                       .replay_routes = routes.data(),
                       .routes_out = replayed.data()});
    EXPECT_EQ(replayed, routes) << "row " << r;
    // Step s's logits came from the position before new token s.
    const int64_t P = int64_t(prompts()[r].size());
    double scale = 0, worst = 0;
    for (size_t s = 0; s < gen->logits[r].size(); ++s) {
      const float* t = logits.data() + (P - 1 + int64_t(s)) * V;
      for (int64_t i = 0; i < V; ++i) {
        scale = std::max(scale, double(std::fabs(t[i])));
        worst = std::max(worst, double(std::fabs(gen->logits[r][s][size_t(i)] - t[i])));
      }
    }
    EXPECT_LE(worst, kReassociation * scale) << "row " << r;
  }
  std::printf("routes: %lld of %lld token-layers the trainer's own router's too\n", (long long)same,
              (long long)token_layers);
  EXPECT_GE(double(same), 0.97 * double(token_layers));
}

// A wrong weight must show: the fp8 bounds fail when every expert's down_proj in layer 0 has
// its block scale doubled, which is what a misplaced scale would do.
TEST(InferenceWorker, AWrongScaleBreaksTheBounds) {
  OneComputeThread one;
  const model::ModelConfig c = config_named("tiny");
  const std::vector<float> w = test_weights(c, 42);
  auto held =
      tensors_of(transfer::reference_receiver_tensors(c, {.format = WeightFormat::kFP8}, w));
  const TrainerRun f32_run = run_trainer(*trainer_with(c, w));
  const double uS = kFp8U * f32_run.scale;
  auto worker = InferenceWorker::create({.config = c, .layout = {.format = WeightFormat::kFP8}});
  ASSERT_TRUE(worker.ok());
  Quantiles good, bad;
  for (Quantiles* q : {&good, &bad}) {
    if (q == &bad) {
      for (int64_t x = 0; x < c.num_experts; ++x) {
        held["layers.0.moe.experts." + std::to_string(x) + ".down_proj.weight.scale"]
            .data<float>()[0] *= 2.0f;
      }
    }
    auto bound = (*worker)->bind(lookup_in(held));
    ASSERT_TRUE(bound.ok());
    auto logits = (*worker)->prompt_logits(*bound, prompts());
    ASSERT_TRUE(logits.ok());
    *q = quantiles(prompt_errors({*logits, {}}, f32_run, c.vocab_size));
  }
  EXPECT_LE(good.median, kFp8Bounds.median * uS);
  EXPECT_LE(good.p90, kFp8Bounds.p90 * uS);
  EXPECT_GT(bad.median, kFp8Bounds.median * uS) << "good median " << good.median / uS << " u S";
  EXPECT_GT(bad.p90, kFp8Bounds.p90 * uS) << "good p90 " << good.p90 / uS << " u S";
}

// The weights arrive by a real p2p update (trainer -> two TP-2 receivers, fp8, then a second
// update with other weights), and the worker generates from each receiver's ReadGuard: its
// logits equal bit for bit those computed from the reference transform's tensors (so what
// arrived is what the reference says), and match the trainer's f32 model within the fp8
// bound, with the same greedy tokens.
TEST(InferenceWorker, GeneratesFromWeightsDeliveredByAP2pUpdate) {
  const transfer::testing::Case k{.mesh_size = 1, .tp = 2, .format = WeightFormat::kFP8};
  const model::ModelConfig c = config_named(k.preset);
  const std::vector<float> a = test_weights(c, 1), b = test_weights(c, 2);
  std::mutex mu;
  std::vector<Generation> gens[2];  // per version, per receiver
  OneComputeThread one;
  transfer::testing::run_world(k.size(), [&](int rank, std::shared_ptr<comm::Group> world) {
    OneComputeThread one_per_rank;
    transfer::testing::Rank r = transfer::testing::join(k, rank, world, a);
    const bool receiver = r.receiver != nullptr;
    auto tp = world->split({.color = receiver ? 0 : comm::kNoColor, .key = r.layout.tp_rank});
    ASSERT_TRUE(tp.ok()) << tp.status().to_string();
    auto plan = transfer::plan_transfer(*world, r.meta);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    if (!receiver) {
      auto ex = transfer::testing::make_executor(r, *plan);
      ASSERT_TRUE(ex.ok()) << ex.status().to_string();
      for (int v = 1; v <= 2; ++v) {
        if (v == 2) r.weights->assign_full(b);
        auto rep = (*ex)->update({.checksums = true});
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
      }
      return;
    }
    auto ex = transfer::testing::make_executor(r, *plan);
    ASSERT_TRUE(ex.ok()) << ex.status().to_string();
    auto worker = InferenceWorker::create({.config = c, .layout = r.layout, .tp_group = *tp});
    ASSERT_TRUE(worker.ok()) << worker.status().to_string();
    const GenerateOptions opts{.max_new_tokens = kNewTokens, .keep_logits = true};
    for (int v = 1; v <= 2; ++v) {
      auto rep = (*ex)->update({.checksums = true});
      ASSERT_TRUE(rep.ok()) << rep.status().to_string();
      auto got = (*worker)->generate(*r.receiver, prompts(), opts);
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      EXPECT_EQ(got->version, uint64_t(v));
      // The same computation over the reference transform's bytes.
      const auto held =
          tensors_of(transfer::reference_receiver_tensors(c, r.layout, v == 1 ? a : b));
      auto bound = (*worker)->bind(lookup_in(held));
      ASSERT_TRUE(bound.ok()) << bound.status().to_string();
      auto want = (*worker)->generate(*bound, prompts(), opts);
      ASSERT_TRUE(want.ok()) << want.status().to_string();
      EXPECT_EQ(got->tokens, want->tokens);
      EXPECT_EQ(got->logits, want->logits) << "tp rank " << r.layout.tp_rank << " version " << v;
      std::lock_guard<std::mutex> lock(mu);
      gens[v - 1].push_back(*std::move(got));
    }
  });
  for (int v = 1; v <= 2; ++v) {
    SCOPED_TRACE("version " + std::to_string(v));
    ASSERT_EQ(gens[v - 1].size(), 2u);
    EXPECT_EQ(gens[v - 1][0].tokens, gens[v - 1][1].tokens);  // both TP ranks agree
    auto trainer = trainer_with(c, v == 1 ? a : b);
    const TrainerRun run = run_trainer(*trainer);
    const double uS = kFp8U * run.scale;
    const GreedyCheck greedy = check_greedy(*trainer, gens[v - 1][0], kFp8Bounds.p90 * uS);
    const Quantiles q = quantiles(greedy.errors);
    EXPECT_LE(q.median, kFp8Bounds.median * uS);
    EXPECT_LE(q.p90, kFp8Bounds.p90 * uS);
    EXPECT_EQ(greedy.unexplained, 0);
    EXPECT_GE(double(greedy.agree), kFp8Bounds.min_agree * double(greedy.steps));
    std::printf(
        "[measured] p2p tiny fp8 tp2, version %d: decode median %.2f p90 %.2f max %.1f "
        "u S; greedy agrees %lld of %lld\n",
        v, q.median / uS, q.p90 / uS, q.max / uS, (long long)greedy.agree, (long long)greedy.steps);
  }
  // The two versions' weights differ, and so do the generations: the worker read version 2.
  EXPECT_NE(gens[0][0].tokens, gens[1][0].tokens);
}

// A receiver whose layout lacks a tensor (an engine built for another config, say): the
// worker refuses to generate from it, naming the tensor, instead of reading garbage.
TEST(InferenceWorker, AReceiverMissingATensorIsAClearError) {
  const model::ModelConfig c = config_named("tiny");
  transfer::testing::run_world(1, [&](int, std::shared_ptr<comm::Group> world) {
    const LayoutOptions layout{.format = WeightFormat::kFP8};
    auto lay = transfer::inference_layout(c, layout);
    ASSERT_TRUE(lay.ok());
    std::vector<transfer::ReceiverTensorSpec> specs = transfer::tensor_specs(*lay);
    std::erase_if(specs, [](const auto& s) { return s.name == "layers.1.moe_norm.weight"; });
    specs[1].shape = {32};  // layers.0.attn_norm.weight, d is 64
    auto receiver =
        transfer::Receiver::create(world->worker(), {.tensors = specs, .format = layout.format});
    ASSERT_TRUE(receiver.ok()) << receiver.status().to_string();
    auto worker = InferenceWorker::create({.config = c, .layout = layout});
    ASSERT_TRUE(worker.ok());
    auto g = (*worker)->generate(**receiver, prompts(), {.max_new_tokens = 2});
    ASSERT_FALSE(g.ok());
    EXPECT_NE(g.status().message().find("tensor 'layers.0.attn_norm.weight' has shape [32], "
                                        "expected [64]"),
              std::string::npos)
        << g.status().message();
    specs[1].shape = {64};
    receiver =
        transfer::Receiver::create(world->worker(), {.tensors = specs, .format = layout.format});
    ASSERT_TRUE(receiver.ok());
    g = (*worker)->generate(**receiver, prompts(), {.max_new_tokens = 2});
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), StatusCode::kNotFound);
    EXPECT_NE(g.status().message().find("missing tensor 'layers.1.moe_norm.weight'"),
              std::string::npos)
        << g.status().message();
  });
}

// bf16 activations (WorkerOptions::bf16_activations, on a CPU with bf16 GEMMs): bf16 weights
// multiplied as stored against activations rounded to bf16. Against the same worker in f32 on
// the same weights, the logits at every prompt position move by the activations' rounding
// alone: bounded like the weights' own (kBf16Bounds, in u S), and greedy decoding agrees
// but at near ties. Measured (tiny, small-2): median 1.1-1.6 u S, p90 1.9-2.2 u S.
TEST(InferenceWorker, Bf16ActivationsStayWithinBf16Rounding) {
  if (!bf16_activations_supported()) GTEST_SKIP() << "this CPU has no bf16 GEMMs";
  for (const char* preset : {"tiny", "small-2"}) {
    SCOPED_TRACE(preset);
    const model::ModelConfig c = config_named(preset);
    const std::vector<float> w = test_weights(c, 42);
    const LayoutOptions layout{.format = WeightFormat::kBF16};
    const auto held = tensors_of(transfer::reference_receiver_tensors(c, layout, w));
    std::vector<std::vector<Tensor>> logits;
    std::vector<Generation> greedy;
    for (bool bf16 : {false, true}) {
      auto worker =
          InferenceWorker::create({.config = c, .layout = layout, .bf16_activations = bf16});
      ASSERT_TRUE(worker.ok());
      auto bound = (*worker)->bind(lookup_in(held));
      ASSERT_TRUE(bound.ok());
      auto l = (*worker)->prompt_logits(*bound, prompts());
      auto g = (*worker)->generate(*bound, prompts(), {.max_new_tokens = 12});
      ASSERT_TRUE(l.ok() && g.ok());
      logits.push_back(*std::move(l));
      greedy.push_back(*std::move(g));
    }
    const int64_t V = c.vocab_size;
    double scale = 0;
    for (const Tensor& t : logits[0]) {
      scale = std::max(scale, max_abs({t.data<float>(), t.data<float>() + t.numel()}));
    }
    std::vector<double> errors;  // per position: the largest logit change, in u S
    for (size_t p = 0; p < prompts().size(); ++p) {
      const float *a = logits[0][p].data<float>(), *b = logits[1][p].data<float>();
      for (int64_t t = 0; t < logits[0][p].numel() / V; ++t) {
        double e = 0;
        for (int64_t v = t * V; v < (t + 1) * V; ++v)
          e = std::max(e, double(std::fabs(a[v] - b[v])));
        errors.push_back(e / (kBf16U * scale));
      }
    }
    const Quantiles q = quantiles(errors);
    std::printf("[measured] %s bf16 activations vs f32: median %.2f p90 %.2f max %.1f u S\n",
                preset, q.median, q.p90, q.max);
    EXPECT_GT(q.median, 0.0) << "nothing was rounded: the bf16 path did not run";
    EXPECT_LE(q.median, kBf16Bounds.median);
    EXPECT_LE(q.p90, kBf16Bounds.p90);
    size_t leading = 0, steps = 0;  // greedy tokens equal until the first that is not
    for (size_t r = 0; r < prompts().size(); ++r) {
      const std::vector<int64_t>&f32 = greedy[0].tokens[r], &b16 = greedy[1].tokens[r];
      steps += f32.size();
      leading +=
          size_t(std::mismatch(f32.begin(), f32.end(), b16.begin(), b16.end()).first - f32.begin());
    }
    std::printf("[measured] %s greedy: %zu of %zu leading tokens equal\n", preset, leading, steps);
    EXPECT_GE(10 * leading, 8 * steps) << "greedy tokens agree for " << leading << " of " << steps;
  }
}

// ---- expert parallelism ---------------------------------------------------------------------

struct EpOutput {
  std::vector<Tensor> prompt_logits;
  Generation greedy, sampled;
};

// The worker on an engine of tp x ep ranks (threads of one world; rank r is TP rank r % tp of
// EP rank r / tp; one rank: no group), greedy with logits and routes, then sampled with a
// seed, over `rows`.
std::vector<EpOutput> run_ep_worker(const model::ModelConfig& c, const std::vector<float>& w,
                                    WeightFormat format, int tp, int ep,
                                    const std::vector<std::vector<int64_t>>& rows) {
  std::vector<EpOutput> out(static_cast<size_t>(tp * ep));
  auto body = [&](int rank, std::shared_ptr<comm::Group> world) {
    OneComputeThread one;
    const LayoutOptions layout{
        .tp = tp, .tp_rank = rank % tp, .ep = ep, .ep_rank = rank / tp, .format = format};
    const auto [tp_group, ep_group] = engine_groups(world, layout);
    const auto held = tensors_of(transfer::reference_receiver_tensors(c, layout, w));
    auto worker = InferenceWorker::create(
        {.config = c, .layout = layout, .tp_group = tp_group, .ep_group = ep_group});
    ASSERT_TRUE(worker.ok()) << worker.status().to_string();
    auto bound = (*worker)->bind(lookup_in(held));
    ASSERT_TRUE(bound.ok()) << bound.status().to_string();
    auto logits = (*worker)->prompt_logits(*bound, rows);
    ASSERT_TRUE(logits.ok()) << logits.status().to_string();
    auto greedy = (*worker)->generate(
        *bound, rows, {.max_new_tokens = kNewTokens, .keep_logits = true, .keep_routes = true});
    ASSERT_TRUE(greedy.ok()) << greedy.status().to_string();
    auto sampled = (*worker)->generate(*bound, rows,
                                       {.max_new_tokens = kNewTokens,
                                        .sampling = {.temperature = 1.0f, .top_k = 20},
                                        .seed = 7,
                                        .stop_token = 'e'});
    ASSERT_TRUE(sampled.ok()) << sampled.status().to_string();
    out[size_t(rank)] = {*std::move(logits), *std::move(greedy), *std::move(sampled)};
  };
  if (tp * ep == 1) {
    body(0, nullptr);
  } else {
    transfer::testing::run_world(tp * ep, body);
  }
  return out;
}

// An engine of EP ranks computes what the same engine without EP does (one rank, or its TP
// ranks): each EP rank generates its share of the rows, and an expert runs every rank's rows
// in rank order, the order one process runs them. The GEMMs see other row counts (a rank's
// share of the attention, each expert's rows from several ranks), which changes f32
// reassociation and nothing else: rank 0 returns every row, with the same tokens, routes and
// sampled tokens (row r samples with seed + r wherever it runs) and logits and log-probs
// within reassociation, also with fewer rows than ranks (a rank with none still serves the
// others' tokens), and with TP as well (each EP rank's TP ranks splitting heads and each
// expert's ffn rows). prompt_logits feeds every row on every rank and agrees as well.
TEST(InferenceWorker, ExpertParallelRanksComputeWhatOneRankDoes) {
  struct Case {
    const char* preset;
    WeightFormat format;
    int tp, ep;
    size_t rows;
  };
  for (const Case& k :
       {Case{"tiny", WeightFormat::kBF16, 1, 2, 4}, Case{"tiny", WeightFormat::kFP8, 1, 4, 4},
        Case{"small-2", WeightFormat::kFP8, 1, 2, 4},
        Case{"tiny-qwen3-moe", WeightFormat::kBF16, 1, 2, 4},
        Case{"tiny", WeightFormat::kBF16, 1, 4, 2}, Case{"tiny", WeightFormat::kBF16, 2, 2, 4},
        Case{"small-2", WeightFormat::kFP8, 2, 2, 3}}) {
    const std::string name = std::string(k.preset) + " " +
                             std::string(transfer::weight_format_name(k.format)) + " tp" +
                             std::to_string(k.tp) + " ep" + std::to_string(k.ep) + ", " +
                             std::to_string(k.rows) + " rows";
    SCOPED_TRACE(name);
    const model::ModelConfig c = config_named(k.preset);
    const std::vector<float> w = test_weights(c, 42);
    const std::vector<std::vector<int64_t>> rows(prompts().begin(),
                                                 prompts().begin() + int64_t(k.rows));
    const std::vector<EpOutput> one = run_ep_worker(c, w, k.format, k.tp, 1, rows);
    const std::vector<EpOutput> ep = run_ep_worker(c, w, k.format, k.tp, k.ep, rows);
    if (::testing::Test::HasFatalFailure()) return;
    const Generation &a = one[0].greedy, &b = ep[0].greedy;
    EXPECT_EQ(b.tokens, a.tokens);
    EXPECT_EQ(b.routes, a.routes);
    EXPECT_EQ(ep[0].sampled.tokens, one[0].sampled.tokens);
    LogitGap gap;
    ASSERT_EQ(b.logits.size(), a.logits.size());
    for (size_t r = 0; r < a.logits.size(); ++r) {
      ASSERT_EQ(b.logits[r].size(), a.logits[r].size()) << "row " << r;
      for (size_t s = 0; s < a.logits[r].size(); ++s)
        gap.add(b.logits[r][s].data(), a.logits[r][s].data(), a.logits[r][s].size());
    }
    for (int r = 0; r < k.tp * k.ep; ++r) {
      for (size_t p = 0; p < rows.size(); ++p) {
        gap.add(ep[size_t(r)].prompt_logits[p].data<float>(), one[0].prompt_logits[p].data<float>(),
                size_t(one[0].prompt_logits[p].numel()));
      }
    }
    EXPECT_LE(gap.gap, kReassociation * gap.scale);
    double logprob_gap = 0;
    ASSERT_EQ(ep[0].sampled.logprobs.size(), one[0].sampled.logprobs.size());
    for (size_t r = 0; r < one[0].sampled.logprobs.size(); ++r) {
      for (size_t s = 0; s < one[0].sampled.logprobs[r].size(); ++s) {
        logprob_gap = std::max(
            logprob_gap, std::fabs(ep[0].sampled.logprobs[r][s] - one[0].sampled.logprobs[r][s]));
      }
    }
    EXPECT_LE(logprob_gap, kReassociation * gap.scale);
    for (int r = k.tp; r < k.tp * k.ep; ++r) {  // EP ranks but the first, each TP rank
      EXPECT_TRUE(ep[size_t(r)].greedy.tokens.empty()) << "rank " << r << " kept rows";
    }
    std::printf(
        "[measured] %s: the tokens and routes without EP; logits within %.2g S, sampled "
        "log-probs within %.2g\n",
        name.c_str(), gap.gap / gap.scale, logprob_gap);
  }
}

// What cannot be an EP engine is refused when the worker is made, naming the cause.
TEST(InferenceWorker, AnExpertParallelLayoutThatCannotBeIsRefused) {
  const model::ModelConfig c = config_named("tiny");  // 4 experts
  auto three = InferenceWorker::create({.config = c, .layout = {.ep = 3}});
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.status().message().find("ep 3 does not divide the model's 4 experts"),
            std::string::npos)
      << three.status().message();
  auto no_group = InferenceWorker::create({.config = c, .layout = {.ep = 2}});
  ASSERT_FALSE(no_group.ok());
  EXPECT_NE(no_group.status().message().find("needs an EP group"), std::string::npos);
  auto dense = InferenceWorker::create({.config = config_named("tiny-llama"), .layout = {.ep = 2}});
  ASSERT_FALSE(dense.ok());
  EXPECT_NE(dense.status().message().find("does not divide the model's 0 experts"),
            std::string::npos)
      << dense.status().message();
}

}  // namespace
}  // namespace wl::infer
