// The compute pool's thread count against the worker's bits.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "run_worker.h"
#include "weightlift/infer/worker.h"

namespace wl::infer {
namespace {

using namespace wl::infer::testing;  // worker_fixture.h, run_worker.h
using transfer::WeightFormat;

// The pool's threads change who computes what, not the bits. With 3 compute threads a step's
// experts mostly run one per thread (at least 3 of tiny's 4 have rows); with 5, more than it
// has, always one after another with their GEMMs shared (worker.cc, run_experts).
TEST(InferenceWorker, ComputeThreadsDoNotChangeTheBits) {
  const model::ModelConfig c = config_named("tiny");
  const std::vector<float> w = test_weights(c, 42);
  const int64_t pages = WorkerOptions{}.kv_page_tokens;
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8}) {
    const std::vector<RankOutput> one = run_worker(c, w, f, 1, pages, 1);
    for (int threads : {3, 5}) {
      SCOPED_TRACE(std::string(transfer::weight_format_name(f)) + ", " + std::to_string(threads) +
                   " threads");
      const std::vector<RankOutput> many = run_worker(c, w, f, 1, pages, threads);
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_EQ(many[0].gen.tokens, one[0].gen.tokens);
      EXPECT_TRUE(many[0].gen.logits == one[0].gen.logits) << "a decode step's logits differ";
      for (size_t p = 0; p < prompts().size(); ++p) {
        EXPECT_EQ(std::memcmp(many[0].prompt_logits[p].raw(), one[0].prompt_logits[p].raw(),
                              one[0].prompt_logits[p].nbytes()),
                  0)
            << "prompt " << p;
      }
    }
  }
}

}  // namespace
}  // namespace wl::infer
