// Continuous batching in the inference worker (infer/batching.cc): rows over a fixed set of
// slots, a GRPO group's prompt prefilled once, per-row limits and stop sequences. The
// reference is the same worker running every row at once (and, for sharing, prefilling every
// row): slots and sharing change which rows share a GEMM (f32 reassociation) and nothing else.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "reference_tensors.h"
#include "weightlift/infer/worker.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "worker_fixture.h"

namespace wl::infer {
namespace {

using namespace wl::infer::testing;  // worker_fixture.h

// Rank 0's generations of `rows` under each of `options` in turn (one worker per rank), on an
// engine of tp x ep thread-ranks over the test weights of `tiny`.
std::vector<Generation> run_engine(int tp, int ep, const std::vector<std::vector<int64_t>>& rows,
                                   const std::vector<GenerateOptions>& options,
                                   int64_t page_tokens = WorkerOptions{}.kv_page_tokens,
                                   bool widen_per_generation = false) {
  const model::ModelConfig c = config_named("tiny");
  const std::vector<float> w = test_weights(c, 42);
  std::vector<Generation> out(options.size());
  transfer::testing::run_world(tp * ep, [&](int rank, std::shared_ptr<comm::Group> world) {
    OneComputeThread one;
    const LayoutOptions layout{.tp = tp, .tp_rank = rank % tp, .ep = ep, .ep_rank = rank / tp};
    const auto [tp_group, ep_group] = engine_groups(world, layout);
    const auto held = tensors_of(transfer::reference_receiver_tensors(c, layout, w));
    auto worker = InferenceWorker::create({.config = c,
                                           .layout = layout,
                                           .tp_group = tp_group,
                                           .ep_group = ep_group,
                                           .kv_page_tokens = page_tokens,
                                           .widen_per_generation = widen_per_generation});
    ASSERT_TRUE(worker.ok()) << worker.status().to_string();
    auto bound = (*worker)->bind(lookup_in(held));
    ASSERT_TRUE(bound.ok());
    for (size_t i = 0; i < options.size(); ++i) {
      auto g = (*worker)->generate(*bound, rows, options[i]);
      ASSERT_TRUE(g.ok()) << g.status().to_string();
      if (rank == 0) out[i] = *std::move(g);
    }
  });
  return out;
}

// Tokens and routes equal, logits and log-probs within reassociation.
void expect_same_rows(const Generation& a, const Generation& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.routes, b.routes);
  LogitGap gap;
  ASSERT_EQ(a.logits.size(), b.logits.size());
  for (size_t r = 0; r < a.logits.size(); ++r) {
    ASSERT_EQ(a.logits[r].size(), b.logits[r].size()) << "row " << r;
    for (size_t k = 0; k < a.logits[r].size(); ++k)
      gap.add(a.logits[r][k].data(), b.logits[r][k].data(), a.logits[r][k].size());
  }
  EXPECT_LE(gap.gap, kReassociation * std::max(gap.scale, 1.0));
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
  for (size_t r = 0; r < a.logprobs.size(); ++r) {
    ASSERT_EQ(a.logprobs[r].size(), b.logprobs[r].size());
    for (size_t k = 0; k < a.logprobs[r].size(); ++k)
      EXPECT_NEAR(a.logprobs[r][k], b.logprobs[r][k], kReassociation * std::max(gap.scale, 1.0));
  }
}

// Three prompts four times each (GRPO groups), then one alone.
std::vector<std::vector<int64_t>> grouped_rows() {
  std::vector<std::vector<int64_t>> rows;
  for (int p = 0; p < 3; ++p) {
    for (int g = 0; g < 4; ++g) rows.push_back(prompts()[size_t(p)]);
  }
  rows.push_back(prompts()[3]);
  return rows;
}

// A GRPO batch holds each prompt G times: its prefill runs once, in the prompt's first row,
// and the others take that row's keys, values, routes and first logits. Against prefilling
// every row (share_prompts off): the same greedy and sampled tokens and routes, logits within
// reassociation (the prefill's GEMMs see fewer rows); one rank, TP 2 and EP 2 (each EP rank
// shares within its own rows).
TEST(InferenceWorker, RowsOfOnePromptArePrefilledOnceAndSampleAsIfEachWere) {
  const std::vector<std::vector<int64_t>> rows = grouped_rows();
  for (const auto& [tp, ep] :
       {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}, std::pair{2, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep));
    std::vector<GenerateOptions> options;
    for (bool share : {true, false}) {
      options.push_back(
          {.max_new_tokens = 12, .keep_logits = true, .keep_routes = true, .share_prompts = share});
      options.push_back({.max_new_tokens = 12,
                         .sampling = {.temperature = 1.0f},
                         .seed = 5,
                         .keep_logits = true,
                         .share_prompts = share});
    }
    const std::vector<Generation> g = run_engine(tp, ep, rows, options);
    if (::testing::Test::HasFatalFailure()) return;
    expect_same_rows(g[0], g[2]);  // greedy: shared against every row prefilled
    expect_same_rows(g[1], g[3]);  // sampled
  }
}

// The prompt tokens a generation over `slots` slots prefills when row r produces exactly
// limits[r] tokens, as the schedule of batching.cc says: each step, free slots take the next
// rows in order (lowest slot first); a row prefills its prompt unless a row of the same
// prompt is in a slot (or is being prefilled this step); a row frees its slot after its last
// token's step.
int64_t expected_prefill(const std::vector<std::vector<int64_t>>& rows,
                         const std::vector<int64_t>& limits, size_t slots) {
  std::vector<size_t> slot_row(slots, SIZE_MAX);
  std::vector<int64_t> left(slots, 0);
  int64_t prefilled = 0;
  for (size_t next = 0, live = 0; next < rows.size() || live > 0;) {
    for (size_t s = 0; s < slots && next < rows.size(); ++s) {
      if (slot_row[s] != SIZE_MAX) continue;
      const bool held = std::any_of(slot_row.begin(), slot_row.end(), [&](size_t r) {
        return r != SIZE_MAX && rows[r] == rows[next];
      });
      if (!held) prefilled += int64_t(rows[next].size());
      slot_row[s] = next;
      left[s] = limits[next];
      ++next;
      ++live;
    }
    for (size_t s = 0; s < slots; ++s) {
      if (slot_row[s] != SIZE_MAX && --left[s] == 0) {
        slot_row[s] = SIZE_MAX;
        --live;
      }
    }
  }
  return prefilled;
}

// Fewer slots than rows: a row that stops frees its slot, the next waiting row is prefilled
// into it beside the others' decode, and no row's tokens change: greedy with logits and
// routes, and sampled with a stop token, rows of different limits (so they stop at different
// steps), one slot to every row at once, on one rank and on EP 2 (slots per EP rank). A
// group's prompt is prefilled once while one of its rows holds a slot, and again when none
// does: the prefilled tokens say which.
TEST(InferenceWorker, RowsOverFewerSlotsSampleWhatEveryRowAtOnceDoes) {
  const std::vector<std::vector<int64_t>> rows = grouped_rows();
  std::vector<int64_t> limits;
  for (size_t r = 0; r < rows.size(); ++r) limits.push_back(2 + int64_t(r * 7 % 11));
  limits[0] = 1;  // a prompt's holder that stops at the step it prefilled, its group copying
  int64_t every_prompt = 0, distinct = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    every_prompt += int64_t(rows[r].size());
    if (r % 4 == 0) distinct += int64_t(rows[r].size());
  }
  // A stop token the sampled rows meet: the second token of the longest row of a sampled run
  // without one (a row's tokens up to its stop do not depend on the stop).
  const kernels::SamplingOptions sampling{.temperature = 1.0f, .top_k = 20};
  const Generation free_run = run_engine(
      1, 1, rows,
      {{.max_new_tokens = 12, .sampling = sampling, .seed = 3, .max_new_per_row = limits}})[0];
  if (::testing::Test::HasFatalFailure()) return;
  const size_t longest = size_t(std::max_element(limits.begin(), limits.end()) - limits.begin());
  const int64_t stop = free_run.tokens[longest][1];
  for (const auto& [tp, ep] : {std::pair{1, 1}, std::pair{1, 2}}) {
    std::vector<GenerateOptions> options;
    for (int64_t slots : {0, 1, 3, 5}) {
      options.push_back({.max_new_tokens = 12,
                         .keep_logits = true,
                         .keep_routes = true,
                         .slots = slots,
                         .max_new_per_row = limits});
      options.push_back({.max_new_tokens = 12,
                         .sampling = sampling,
                         .seed = 3,
                         .stop_token = stop,
                         .keep_logits = true,
                         .slots = slots,
                         .max_new_per_row = limits});
    }
    const std::vector<Generation> g = run_engine(tp, ep, rows, options);
    if (::testing::Test::HasFatalFailure()) return;
    size_t stopped_early = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      EXPECT_EQ(int64_t(g[0].tokens[r].size()), limits[r]) << "row " << r;
      EXPECT_LE(int64_t(g[1].tokens[r].size()), limits[r]) << "row " << r;
      stopped_early += int64_t(g[1].tokens[r].size()) < limits[r] && g[1].tokens[r].back() == stop;
    }
    EXPECT_GE(stopped_early, 1u) << "the stop token ends no sampled row early";
    for (size_t i = 2; i < g.size(); ++i) {
      SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep) + ", slots " +
                   std::to_string(options[i].slots) + (i % 2 ? ", sampled" : ", greedy"));
      expect_same_rows(g[i], g[i % 2]);
    }
    if (ep == 1) {
      EXPECT_EQ(g[0].prefill_tokens, distinct);      // every row at once: each prompt once
      EXPECT_EQ(g[2].prefill_tokens, every_prompt);  // one slot: no row finds its prompt held
      EXPECT_EQ(g[4].prefill_tokens, expected_prefill(rows, limits, 3));
      EXPECT_EQ(g[6].prefill_tokens, expected_prefill(rows, limits, 5));
      EXPECT_GT(g[4].prefill_tokens, distinct);  // 3 slots: a group's rows outlive its holder
      EXPECT_LT(g[4].prefill_tokens, every_prompt);
      std::printf(
          "[measured] prefilled tokens: %ld every row at once, %ld over 3 slots, %ld over "
          "5, %ld over 1 (prompts %ld distinct, %ld in all)\n",
          long(g[0].prefill_tokens), long(g[4].prefill_tokens), long(g[6].prefill_tokens),
          long(g[2].prefill_tokens), long(distinct), long(every_prompt));
    }
  }
}

// The KV pages of the tests below: 32 positions.
constexpr int64_t kPage = 32;
double tiny_page_bytes() {
  const model::ModelConfig c = config_named("tiny");
  return double(c.num_layers) * 2.0 * double(kPage) * double(c.num_kv_heads * c.head_dim) * 4.0;
}

// The KV cache holds a prompt once for all the running rows that share it, and each row's own
// tokens apart, in pages taken as rows reach them and given back as rows end. In pages of 32
// tokens, prompts 0-2 and every row's 7 fed tokens take one page, prompt 3 (34 tokens) two, so
// the most pages held at once are: every row at once 5 for the prompts + 13 for the rows, or
// 14 + 13 prefilling every row; over 2 slots (rows in pairs of one prompt, then row 12 alone)
// 1 + 2; over 6 slots 2 + 6 (rows 0-5 are 4 of prompt 0 and 2 of prompt 1; all stop together,
// and rows 6-11 are 2 of prompt 1 and 4 of prompt 2).
TEST(InferenceWorker, AGroupsPromptIsHeldOnceInTheKvCache) {
  const double page = tiny_page_bytes();
  const std::vector<Generation> g = run_engine(1, 1, grouped_rows(),
                                               {{.max_new_tokens = 8},
                                                {.max_new_tokens = 8, .share_prompts = false},
                                                {.max_new_tokens = 8, .slots = 2},
                                                {.max_new_tokens = 8, .slots = 6}},
                                               kPage);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(g[0].kv_cache_bytes, 18 * page);
  EXPECT_EQ(g[1].kv_cache_bytes, 27 * page);
  EXPECT_EQ(g[2].kv_cache_bytes, 3 * page);
  EXPECT_EQ(g[3].kv_cache_bytes, 8 * page);
  EXPECT_EQ(g[0].tokens, g[1].tokens);
  std::printf(
      "[measured] KV cache of 13 rows of 4 prompts, 8 new tokens: %.0f bytes shared, "
      "%.0f prefilling every row (%.2fx)\n",
      g[0].kv_cache_bytes, g[1].kv_cache_bytes, g[1].kv_cache_bytes / g[0].kv_cache_bytes);
}

// The worker keeps its pages from one generation to the next and allocates only when one
// needs more than it has, 16 pages at a time: 3 pages (16 allocated), 18 (32), then 3 and 27
// again from the 32 it has (pages of 32 tokens, as above).
TEST(InferenceWorker, KvPagesAreKeptAndAllocatedOnlyWhenAGenerationNeedsMore) {
  const double page = tiny_page_bytes();
  const std::vector<Generation> g = run_engine(1, 1, grouped_rows(),
                                               {{.max_new_tokens = 8, .slots = 2},
                                                {.max_new_tokens = 8},
                                                {.max_new_tokens = 8, .slots = 2},
                                                {.max_new_tokens = 8, .share_prompts = false}},
                                               kPage);
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<double> pool{g[0].kv_pool_bytes / page, g[1].kv_pool_bytes / page,
                                 g[2].kv_pool_bytes / page, g[3].kv_pool_bytes / page};
  EXPECT_EQ(pool, (std::vector<double>{16, 32, 32, 32}));
  EXPECT_EQ(g[1].kv_cache_bytes, 18 * page);
  EXPECT_EQ(g[3].kv_cache_bytes, 27 * page);
  EXPECT_EQ(g[2].tokens, g[0].tokens);
}

// Ten tokens per row, greedy on every row at once and sampled (seed `seed`) over 5 slots, both
// keeping logits and routes: the two runs a test compares two engine setups with.
std::vector<GenerateOptions> greedy_and_sampled_over_slots(uint64_t seed) {
  return {{.max_new_tokens = 10, .keep_logits = true, .keep_routes = true},
          {.max_new_tokens = 10,
           .sampling = {.temperature = 1.0f, .top_k = 20},
           .seed = seed,
           .keep_logits = true,
           .keep_routes = true,
           .slots = 5}};
}

// Pages of 3 tokens cut every prompt and every row's own tokens into several pages, attended
// as one sequence: the rows' tokens and routes are those of 64-token pages (where all fit in
// one), their logits within reassociation; on one rank and TP 2, every row at once and over
// 5 slots.
TEST(InferenceWorker, RowsInSmallPagesSampleWhatRowsInOnePageDo) {
  const std::vector<std::vector<int64_t>> rows = grouped_rows();
  const std::vector<GenerateOptions> options = greedy_and_sampled_over_slots(5);
  for (const int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const std::vector<Generation> whole = run_engine(tp, 1, rows, options, 64);
    const std::vector<Generation> paged = run_engine(tp, 1, rows, options, 3);
    if (::testing::Test::HasFatalFailure()) return;
    for (size_t i = 0; i < options.size(); ++i) expect_same_rows(paged[i], whole[i]);
    EXPECT_GT(paged[0].kv_cache_bytes, 0.0);
  }
}

// Weights widened to f32 once for the whole generation instead of a band per step: the same
// tokens and routes, logits within reassociation (the GEMMs run over whole matrices, not
// bands); one rank, TP 2 and EP 2, greedy and sampled over slots.
TEST(InferenceWorker, WeightsWidenedOncePerGenerationSampleWhatBandsDo) {
  const std::vector<std::vector<int64_t>> rows = grouped_rows();
  const std::vector<GenerateOptions> options = greedy_and_sampled_over_slots(3);
  for (const auto& [tp, ep] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep));
    const std::vector<Generation> bands = run_engine(tp, ep, rows, options);
    const std::vector<Generation> once =
        run_engine(tp, ep, rows, options, WorkerOptions{}.kv_page_tokens, true);
    if (::testing::Test::HasFatalFailure()) return;
    for (size_t i = 0; i < options.size(); ++i) expect_same_rows(once[i], bands[i]);
  }
}

// A row stops once its new tokens end with a stop sequence (kept in its tokens), or at its
// own limit, or where a caller's rule says: each row's tokens are those of the run without
// any, cut at the first point where one applies, with every row at once and over two slots.
TEST(InferenceWorker, StopSequencesAndPerRowLimitsEndRowsWhereTheySay) {
  const std::vector<std::vector<int64_t>> rows = grouped_rows();
  const GenerateOptions plain{.max_new_tokens = 16, .share_prompts = false};
  const Generation free_run = run_engine(1, 1, rows, {plain})[0];
  if (::testing::Test::HasFatalFailure()) return;
  // Two sequences seen in the free run: one from row 0's tokens, one from the last row's.
  const std::vector<std::vector<int64_t>> stops{{free_run.tokens[0][4], free_run.tokens[0][5]},
                                                {free_run.tokens.back()[2]}};
  std::vector<int64_t> limits;
  for (size_t r = 0; r < rows.size(); ++r) limits.push_back(4 + int64_t(r % 3) * 6);
  std::vector<std::vector<int64_t>> expected;
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<int64_t> t;
    for (int64_t token : free_run.tokens[r]) {
      t.push_back(token);
      const bool stop = std::any_of(stops.begin(), stops.end(), [&](const auto& s) {
        return t.size() >= s.size() && std::equal(s.rbegin(), s.rend(), t.rbegin());
      });
      if (stop || int64_t(t.size()) == limits[r]) break;
    }
    expected.push_back(t);
  }
  std::vector<GenerateOptions> options;
  for (int64_t slots : {0, 2}) {
    options.push_back(
        {.max_new_tokens = 16, .slots = slots, .max_new_per_row = limits, .stop_sequences = stops});
  }
  // A caller's rule (stop strings on text) in place of the sequences, given each row's index
  // among the prompts: the same cuts, on one rank and on EP 2 (each rank its own rows).
  GenerateOptions rule{.max_new_tokens = 16, .slots = 2, .max_new_per_row = limits};
  rule.stop_when = [&expected](size_t row, const std::vector<int64_t>& tokens) {
    return tokens.size() == expected[row].size();
  };
  options.push_back(rule);
  const std::vector<Generation> g = run_engine(1, 1, rows, options);
  const std::vector<Generation> ep = run_engine(1, 2, rows, {rule});
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(g[2].tokens, expected);
  EXPECT_EQ(ep[0].tokens, expected);
  size_t cut_by_stop = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    cut_by_stop += int64_t(expected[r].size()) < limits[r];
  }
  EXPECT_GE(cut_by_stop, 2u) << "the stop sequences end too few rows to test them";
  EXPECT_EQ(g[0].tokens, expected);
  EXPECT_EQ(g[1].tokens, expected);
}

// Options that cannot run are refused before any work, naming what is wrong.
TEST(InferenceWorker, GenerationOptionsThatCannotRunAreRefused) {
  const model::ModelConfig c = config_named("tiny");
  const std::vector<float> w = test_weights(c, 42);
  const LayoutOptions layout{};
  const auto held = tensors_of(transfer::reference_receiver_tensors(c, layout, w));
  auto worker = InferenceWorker::create({.config = c, .layout = layout});
  ASSERT_TRUE(worker.ok());
  auto bound = (*worker)->bind(lookup_in(held));
  ASSERT_TRUE(bound.ok());
  const std::vector<std::vector<int64_t>> rows{prompts()[0], prompts()[1]};
  const int64_t long_prompt = int64_t(prompts()[0].size());
  struct Case {
    GenerateOptions options;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {{.max_new_tokens = 0}, "max_new_tokens is 0"},
      {{.slots = -1}, "slots is -1"},
      {{.max_new_tokens = 4, .max_new_per_row = {2}}, "max_new_per_row has 1 entries for 2"},
      {{.max_new_tokens = 4, .max_new_per_row = {2, 0}}, "max_new_per_row[1] is 0"},
      {{.max_new_tokens = 4, .max_new_per_row = {5, 1}}, "max_new_per_row[0] is 5"},
      {{.stop_sequences = {{1}, {}}}, "stop sequence 1 is empty"},
      {{.stop_sequences = {{c.vocab_size}}}, "stop sequence 0 holds a token outside"},
      {{.max_new_tokens = c.max_seq_len, .max_new_per_row = {c.max_seq_len - long_prompt + 1, 1}},
       "prompt 0 has"},
  };
  for (const Case& k : cases) {
    auto g = (*worker)->generate(*bound, rows, k.options);
    ASSERT_FALSE(g.ok()) << k.needle;
    EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << k.needle;
    EXPECT_NE(g.status().message().find(k.needle), std::string::npos) << g.status().message();
  }
  // The limits that fit run: a long prompt with few new tokens beside a short one with many.
  auto fits = (*worker)->generate(
      *bound, rows,
      {.max_new_tokens = c.max_seq_len - 8, .max_new_per_row = {2, c.max_seq_len - 8}});
  EXPECT_TRUE(fits.ok()) << fits.status().to_string();
}

}  // namespace
}  // namespace wl::infer
