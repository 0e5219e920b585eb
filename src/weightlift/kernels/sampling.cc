/* Decoding: argmax, and seeded sampling with temperature, top-k and top-p filters.
 *
 * Order of operations, as Hugging Face's logits warpers apply them (temperature, top-k,
 * top-p) and vLLM's sampler does:
 *   1. top_k: keep the k largest logits, ties at the boundary resolved to the lower index
 *      (candidates are ordered by (logit descending, index ascending), a total order);
 *   2. probabilities q = softmax(logits / temperature) over the kept tokens;
 *   3. top_p: walk the kept tokens in that order, keep the shortest prefix whose q mass
 *      reaches top_p (at least one token);
 *   4. draw u = rng.uniform() once and return the token where the cumulative mass of the
 *      renormalised survivors first exceeds u times their total.
 * Temperature only rescales logits, so it does not change the order of step 1 and the top-k
 * set is the same with or without it. Greedy (temperature 0) returns argmax and draws
 * nothing from rng; every other call draws exactly one uniform.
 *
 * Cost: without filters, O(vocab) and no sort. With top_k, nth_element + a sort of k
 * candidates; with top_p alone, a sort of the vocabulary. Everything in double: one row per
 * call, so the arithmetic is never the bottleneck and the result does not hinge on f32
 * rounding of the cumulative sum.
 */
#include "weightlift/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "weightlift/core/check.h"

namespace wl::kernels {

int64_t argmax(const float* logits, int64_t vocab) {
  WL_CHECK_GT(vocab, 0);
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;  // strict: equal values keep the lower index
  }
  return best;
}

int64_t sample(const float* logits, int64_t vocab, const SamplingOptions& opts, Rng& rng,
               double* logprob) {
  WL_CHECK_GT(vocab, 0);
  WL_CHECK(opts.temperature >= 0) << "temperature " << opts.temperature;
  WL_CHECK(opts.top_k >= 0) << "top_k " << opts.top_k;
  WL_CHECK(opts.top_p > 0 && opts.top_p <= 1) << "top_p " << opts.top_p;
  if (logprob) *logprob = 0.0;
  if (opts.temperature == 0) return argmax(logits, vocab);

  const bool use_top_k = opts.top_k > 0 && opts.top_k < vocab;
  const bool use_top_p = opts.top_p < 1.0f;
  // Candidate tokens, in (logit desc, index asc) order whenever a filter needs an order.
  std::vector<int64_t> cand(static_cast<size_t>(vocab));
  std::iota(cand.begin(), cand.end(), int64_t(0));
  auto before = [logits](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  if (use_top_k) {
    std::nth_element(cand.begin(), cand.begin() + opts.top_k, cand.end(), before);
    cand.resize(size_t(opts.top_k));
    std::sort(cand.begin(), cand.end(), before);
  } else if (use_top_p) {
    std::sort(cand.begin(), cand.end(), before);
  }

  // q over the candidates; the max subtracted so that exp never overflows.
  double mx = -INFINITY;
  for (int64_t t : cand) mx = std::max(mx, double(logits[t]));
  const double inv_temp = 1.0 / double(opts.temperature);
  std::vector<double> q(cand.size());
  double total = 0;
  for (size_t i = 0; i < cand.size(); ++i) {
    q[i] = std::exp((double(logits[cand[i]]) - mx) * inv_temp);
    total += q[i];
  }
  size_t keep = cand.size();
  if (use_top_p) {
    const double target = double(opts.top_p) * total;
    double mass = 0;
    for (size_t i = 0; i < cand.size(); ++i) {
      mass += q[i];
      if (mass >= target) {
        keep = i + 1;
        break;
      }
    }
    // The survivors' mass, summed in the order the draw below sums it. The loop always
    // breaks: with top_p < 1 the full sum (the same additions as `total`) reaches target.
    total = mass;
  }

  const double u = double(rng.uniform()) * total;
  auto chosen = [&](size_t i) {
    if (logprob) *logprob = std::log(q[i] / total);
    return cand[i];
  };
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += q[i];
    if (u < cum) return chosen(i);
  }
  // u < total in exact arithmetic; rounding can leave it at the end: the last survivor
  // with non-zero probability.
  for (size_t i = keep; i-- > 0;) {
    if (q[i] > 0) return chosen(i);
  }
  return chosen(0);
}

}  // namespace wl::kernels
