// Softmax cross-entropy over a vocabulary, fused with its gradient.
#pragma once

#include <cstdint>

namespace wl::kernels {

inline constexpr int64_t kIgnoreIndex = -100;

struct CrossEntropyResult {
  double loss_sum = 0;  // sum over counted rows of -log softmax(logits)[target]
  int64_t count = 0;    // rows whose target is not kIgnoreIndex
};

// logits: [n, vocab]; targets: [n], each in [0, vocab) or kIgnoreIndex (other values are a
// bug: checked). When dlogits is not null it receives grad_scale * (softmax - onehot) for
// counted rows and zeros for ignored rows; dlogits may alias logits.
CrossEntropyResult cross_entropy(const float* logits, const int64_t* targets, int64_t n,
                                 int64_t vocab, float* dlogits, float grad_scale);

}  // namespace wl::kernels
