// A batch of token ids and targets read from a safetensors file (int64 `tokens` and `targets`,
// both [batch, seq]; targets -100 are ignored), checked against a model config.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"

namespace wl::model {

struct TokenBatch {
  int64_t batch = 0, seq = 0;
  std::vector<int64_t> tokens, targets;  // [batch, seq] each
};

// Errors name the file and what is wrong: a missing tensor, a shape that is not [batch, seq]
// with batch >= 1 and 1 <= seq <= max_seq_len, a token outside the vocabulary, a target that
// is neither -100 nor in the vocabulary.
Result<TokenBatch> load_token_batch(const std::string& path, const ModelConfig& config);

}  // namespace wl::model
