#include "weightlift/model/token_batch.h"

#include "weightlift/core/safetensors.h"
#include "weightlift/kernels/cross_entropy.h"

namespace wl::model {

Result<TokenBatch> load_token_batch(const std::string& path, const ModelConfig& cfg) {
  WL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
  const TensorInfo* info = file.find("tokens");
  if (!info) return not_found(path + ": no tensor 'tokens'");
  if (info->shape.size() != 2 || info->shape[0] < 1 || info->shape[1] < 1 ||
      info->shape[1] > cfg.max_seq_len) {
    return invalid_argument(path + ": tensor 'tokens' has shape " + shape_to_string(info->shape) +
                            ", expected [batch >= 1, seq in 1.." + std::to_string(cfg.max_seq_len) +
                            "]");
  }
  const int64_t B = info->shape[0], T = info->shape[1];
  WL_ASSIGN_OR_RETURN(Tensor tokens, file.get("tokens", DType::kI64, {B, T}));
  WL_ASSIGN_OR_RETURN(Tensor targets, file.get("targets", DType::kI64, {B, T}));
  TokenBatch b{B, T, {}, {}};
  b.tokens.assign(tokens.data<int64_t>(), tokens.data<int64_t>() + B * T);
  b.targets.assign(targets.data<int64_t>(), targets.data<int64_t>() + B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t t = b.tokens[size_t(i)], y = b.targets[size_t(i)];
    if (t < 0 || t >= cfg.vocab_size)
      return invalid_argument(path + ": tokens[" + std::to_string(i) + "] = " + std::to_string(t) +
                              " outside the vocabulary [0, " + std::to_string(cfg.vocab_size) +
                              ")");
    if (y != kernels::kIgnoreIndex && (y < 0 || y >= cfg.vocab_size))
      return invalid_argument(path + ": targets[" + std::to_string(i) + "] = " + std::to_string(y) +
                              " is neither -100 nor in the vocabulary");
  }
  return b;
}

}  // namespace wl::model
