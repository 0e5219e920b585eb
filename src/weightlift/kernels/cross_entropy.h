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

// Targets among targets[0, n) that are not kIgnoreIndex: what a mean cross-entropy divides by.
inline int64_t count_targets(const int64_t* targets, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += targets[i] != kIgnoreIndex;
  return c;
}

// Row by row, for losses whose weight differs per row (policy gradients): row_loss[r] =
// -log softmax(logits_r)[target_r] (0 for ignored rows), and, when dlogits is set,
// dlogits_r = row_scale[r] * (softmax - onehot) (zeros for ignored rows). A caller that needs
// the log-probabilities to choose the scales calls it twice: first without dlogits.
void cross_entropy_rows(const float* logits, const int64_t* targets, int64_t n, int64_t vocab,
                        const float* row_scale, float* dlogits, double* row_loss);

}  // namespace wl::kernels
