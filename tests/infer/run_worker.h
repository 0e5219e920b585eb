// Running the inference worker over the reference transform of a model's weights, at TP 1 or
// 2 (thread-ranks sharing a MemoryStore world), for the tests that compare its outputs.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "../transfer/fixture.h"
#include "reference_tensors.h"
#include "weightlift/infer/worker.h"
#include "weightlift/transfer/layout/reference_transform.h"
#include "worker_fixture.h"

namespace wl::infer::testing {

struct RankOutput {
  std::vector<Tensor> prompt_logits;  // per prompt, [T, V]
  Generation gen;                     // greedy, with logits
};

constexpr int64_t kNewTokens = 24;

// Runs the worker on every TP rank (threads sharing a MemoryStore world when tp > 1) over the
// reference transform of `w`, and returns each rank's output.
inline std::vector<RankOutput> run_worker(const model::ModelConfig& c, const std::vector<float>& w,
                                          transfer::WeightFormat format, int tp,
                                          int64_t page_tokens, int threads = 1) {
  std::vector<RankOutput> out(static_cast<size_t>(tp));
  auto body = [&](int rank, std::shared_ptr<comm::Group> group) {
    ComputeThreads pool(threads);
    const transfer::LayoutOptions layout{.tp = tp, .tp_rank = rank, .format = format};
    const auto held = tensors_of(transfer::reference_receiver_tensors(c, layout, w));
    auto worker = InferenceWorker::create(
        {.config = c, .layout = layout, .tp_group = group, .kv_page_tokens = page_tokens});
    ASSERT_TRUE(worker.ok()) << worker.status().to_string();
    auto bound = (*worker)->bind(lookup_in(held));
    ASSERT_TRUE(bound.ok()) << bound.status().to_string();
    auto logits = (*worker)->prompt_logits(*bound, prompts());
    ASSERT_TRUE(logits.ok()) << logits.status().to_string();
    auto gen =
        (*worker)->generate(*bound, prompts(), {.max_new_tokens = kNewTokens, .keep_logits = true});
    ASSERT_TRUE(gen.ok()) << gen.status().to_string();
    out[size_t(rank)] = {*std::move(logits), *std::move(gen)};
  };
  if (tp == 1) {
    body(0, nullptr);
  } else {
    transfer::testing::run_world(tp, body);
  }
  return out;
}

}  // namespace wl::infer::testing
