// Decoders: greedy (argmax), temperature sampling, top-k and top-p (nucleus), seeded.
#pragma once

#include <cstdint>

#include "weightlift/core/random.h"

namespace wl::kernels {

struct SamplingOptions {
  float temperature = 1.0f;  // 0 means greedy
  int64_t top_k = 0;         // 0 = no top-k filter
  float top_p = 1.0f;        // 1 = no nucleus filter
};

// Index of the largest logit; ties go to the lowest index.
int64_t argmax(const float* logits, int64_t vocab);

// Filters: keep the top_k largest logits (ties at the boundary: lower index kept first), then
// the smallest prefix of the remaining tokens, by descending probability, whose probability
// mass reaches top_p (always at least one token); softmax(logits / temperature) over what is
// left; draw one token with rng.uniform(). Same rng state and inputs give the same token.
// `logprob` (may be null) receives the token's log-probability under the distribution it was
// drawn from (filtered, renormalised, temperature-scaled): what an RL trainer's importance
// weights need. Greedy (temperature 0) draws from a point mass: log-probability 0.
int64_t sample(const float* logits, int64_t vocab, const SamplingOptions& opts, Rng& rng,
               double* logprob = nullptr);

}  // namespace wl::kernels
