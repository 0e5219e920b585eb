/* Softmax cross-entropy fused with its gradient, one pass over the logits per row:
 *   m = max_j x_j,  S = sum_j exp(x_j - m),  lse = m + log S,
 *   loss = lse - x_target,  dlogits_j = grad_scale * (exp(x_j - m) / S - [j == target]).
 * Rows whose target is kIgnoreIndex contribute nothing and get zero gradient.
 *
 * The exponentials are written straight into dlogits and scaled in place, so the row is read
 * three times (max, exp, scale) and never copied; dlogits may alias logits because the target
 * logit is read before the row is overwritten. At the small preset (2048 rows x vocab 320)
 * glibc's scalar expf was most of the kernel's time; the vectorised polynomial below (same
 * as swiglu.cc's) is not. lse and the loss are formed in double, since
 * lse - x_target cancels for confident predictions.
 *
 * Determinism: each row's loss goes to its own slot and the slots are summed in row order
 * afterwards, so loss_sum does not depend on the thread count.
 */
#include "weightlift/kernels/cross_entropy.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/detail/fast_exp.h"
#include "weightlift/kernels/detail/simd.h"

namespace wl::kernels {
namespace {

using detail::fast_exp;
using detail::select;

// Rows [r0, r1): row_loss[r] = loss of row r (0 when ignored); gradient into dlogits if set,
// scaled by row_scale[r] when row_scale is set, else by grad_scale.
WL_MULTIVERSION void rows(const float* logits, const int64_t* targets, int64_t r0, int64_t r1,
                          int64_t vocab, float* dlogits, float grad_scale, const float* row_scale,
                          double* row_loss) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t target = targets[r];
    if (row_scale) grad_scale = row_scale[r];
    const float* x = logits + r * vocab;
    float* d = dlogits ? dlogits + r * vocab : nullptr;
    if (target == kIgnoreIndex) {
      row_loss[r] = 0;
      if (d) std::memset(d, 0, size_t(vocab) * sizeof(float));
      continue;
    }
    WL_CHECK(target >= 0 && target < vocab)
        << "row " << r << " target " << target << " vocab " << vocab;
    const float x_target = x[target];  // before d (maybe x) is overwritten
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < vocab; ++j) mx = x[j] > mx ? x[j] : mx;
    float sum = 0;
    if (d) {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < vocab; ++j) {
        const float e = fast_exp(x[j] - mx);
        d[j] = e;
        sum += e;
      }
      const float scale = grad_scale / sum;
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) d[j] *= scale;
      d[target] -= grad_scale;
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < vocab; ++j) sum += fast_exp(x[j] - mx);
    }
    row_loss[r] = double(mx) + std::log(double(sum)) - double(x_target);
  }
}

}  // namespace

CrossEntropyResult cross_entropy(const float* logits, const int64_t* targets, int64_t n,
                                 int64_t vocab, float* dlogits, float grad_scale) {
  WL_CHECK(n >= 0 && vocab > 0) << "n " << n << " vocab " << vocab;
  std::vector<double> row_loss(static_cast<size_t>(n));
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / vocab);
  parallel_for(n, grain, [&](int64_t r0, int64_t r1) {
    rows(logits, targets, r0, r1, vocab, dlogits, grad_scale, nullptr, row_loss.data());
  });
  CrossEntropyResult out;
  for (int64_t r = 0; r < n; ++r) {
    out.loss_sum += row_loss[size_t(r)];
    out.count += targets[r] != kIgnoreIndex;
  }
  return out;
}

void cross_entropy_rows(const float* logits, const int64_t* targets, int64_t n, int64_t vocab,
                        const float* row_scale, float* dlogits, double* row_loss) {
  WL_CHECK(n >= 0 && vocab > 0) << "n " << n << " vocab " << vocab;
  WL_CHECK(dlogits == nullptr || row_scale != nullptr) << "a gradient needs the rows' scales";
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / vocab);
  parallel_for(n, grain, [&](int64_t r0, int64_t r1) {
    rows(logits, targets, r0, r1, vocab, dlogits, 0.0f, row_scale, row_loss);
  });
}

}  // namespace wl::kernels
