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

namespace wl::kernels {
namespace {

// Branch-free select on bit patterns. A plain `c ? a : b` on floats lets GCC thread the
// clamped (constant) cases of fast_exp into separate paths, which it then may not
// if-convert under -ftrapping-math, and the loop stops vectorising. always_inline: each
// target_clones clone must get its own copy, not call a default-ISA one.
__attribute__((always_inline)) inline float select(bool c, float a, float b) {
  const int32_t m = -int32_t(c);
  return std::bit_cast<float>((std::bit_cast<int32_t>(a) & m) | (std::bit_cast<int32_t>(b) & ~m));
}

// exp(x) to 1.4 ulp on [-87.3, 88.3]; 0 below, inf above, NaN stays NaN. Cody-Waite
// reduction, Cephes' polynomial, 2^n in the exponent bits: see swiglu.cc.
__attribute__((always_inline)) inline float fast_exp(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  const float xc = select(x < -87.3f, -87.3f, select(x > 88.3f, 88.3f, x));
  const float t = xc * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  const float r = xc - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift);
  const float y = p * std::bit_cast<float>((e + 127) << 23);
  return select(x < -87.3f, 0.0f, select(x > 88.3f, INFINITY, y));
}

// Rows [r0, r1): row_loss[r] = loss of row r (0 when ignored); gradient into dlogits if set.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void rows(
    const float* logits, const int64_t* targets, int64_t r0, int64_t r1, int64_t vocab,
    float* dlogits, float grad_scale, double* row_loss) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t target = targets[r];
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
    rows(logits, targets, r0, r1, vocab, dlogits, grad_scale, row_loss.data());
  });
  CrossEntropyResult out;
  for (int64_t r = 0; r < n; ++r) {
    out.loss_sum += row_loss[size_t(r)];
    out.count += targets[r] != kIgnoreIndex;
  }
  return out;
}

}  // namespace wl::kernels
