// policy_loss.h.
#include "weightlift/rl/policy_loss.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace wl::rl {

Result<std::vector<double>> group_advantages(std::span<const double> rewards,
                                             const AdvantageOptions& o) {
  const size_t g = rewards.size();
  for (size_t i = 0; i < g; ++i) {
    if (!std::isfinite(rewards[i])) {
      return invalid_argument("reward of sample " + std::to_string(i) + " of the group is " +
                              std::to_string(rewards[i]) + ", not a finite number");
    }
  }
  std::vector<double> out(g, 0.0);
  // One sample, or nothing to tell the samples apart: no signal (exactly 0, not the rounding
  // of a mean).
  if (g < 2 ||
      std::all_of(rewards.begin(), rewards.end(), [&](double r) { return r == rewards[0]; }))
    return out;
  double mean = 0;
  for (double r : rewards) mean += r;
  mean /= double(g);
  double var = 0;
  for (double r : rewards) var += (r - mean) * (r - mean);
  const double stddev = std::sqrt(var / double(g - 1));
  for (size_t i = 0; i < g; ++i) {
    out[i] = o.normalize_std ? (rewards[i] - mean) / (stddev + o.eps) : rewards[i] - mean;
  }
  return out;
}

TokenTerm policy_token(double logp, double logp_old, double logp_mu, double advantage,
                       double tokens, const PolicyLossOptions& o) {
  TokenTerm t;
  t.ratio = std::exp(logp - logp_old);
  t.is_weight = o.tis_cap > 0 ? std::min(std::exp(logp_old - logp_mu), o.tis_cap) : 1.0;
  const double clipped_ratio = std::clamp(t.ratio, 1.0 - o.clip_low, 1.0 + o.clip_high);
  const double unclipped = t.ratio * advantage, clipped = clipped_ratio * advantage;
  // min(u A, clip(u) A): the clipped term wins (and stops the gradient) only where it is
  // strictly smaller, i.e. where u has left the range in the direction A rewards.
  t.clipped = clipped < unclipped;
  const double objective = t.clipped ? clipped : unclipped;
  t.loss = -t.is_weight * objective / tokens;
  t.coef = t.clipped ? 0.0 : t.is_weight * advantage * t.ratio / tokens;
  return t;
}

KlTerm kl_token(double logp, double logp_ref, double tokens, double beta) {
  const double r = logp_ref - logp, e = std::exp(r);
  KlTerm t;
  t.kl = e - r - 1;
  t.loss = beta * t.kl / tokens;
  t.coef = beta * (e - 1) / tokens;
  return t;
}

}  // namespace wl::rl
