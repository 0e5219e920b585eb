// GRPO's advantages and the policy loss the trainer minimises, token by token.
//
// Advantages (DeepSeekMath's GRPO, outcome rewards): every token of sample i in a group of G
// samples of one prompt gets
//     A_i = (R_i - mean_j R_j) / (std_j R_j + eps)      (std: unbiased, as verl's torch.std)
// or, without the division (Dr. GRPO, normalize_std = false), A_i = R_i - mean_j R_j. A group
// of one sample gets 0. A group whose rewards are all equal gets 0 everywhere (DAPO's dynamic
// sampling keeps such groups out of a batch: orchestrator.h).
//
// Loss (decoupled PPO with DAPO's clip-higher and truncated importance sampling): for a
// completion token with log-probabilities logp under the policy being trained (pi_theta),
// logp_old under the policy the step started from (pi_old: the trainer's recomputation) and
// logp_mu under the policy that sampled it (mu: the rollout worker's),
//     u = exp(logp - logp_old)            the PPO ratio (exactly 1 on a step's first pass)
//     w = min(exp(logp_old - logp_mu), C) the truncated importance weight (TIS), a constant
//     l = -w * min(u A, clip(u, 1 - eps_low, 1 + eps_high) A)
// summed over every completion token of the step and divided by their number over the whole
// global batch (DAPO's token-level mean; the caller passes that count, the same on every
// micro-batch and rank, so the loss does not depend on how the batch is cut). Its gradient in
// logp is -w A u where the unclipped term is the minimum, else 0; the model takes it as the
// coefficient of (softmax - onehot) in d loss / d logits, which is -d l / d logp.
//
// Optional KL penalty to a frozen reference policy (the SFT checkpoint), as GRPO's paper adds
// to the loss rather than the reward: per token, with r = logp_ref - logp, Schulman's k3
// estimator of KL(pi_theta || pi_ref), unbiased and never negative,
//     k = exp(r) - r - 1,     added as beta * k / tokens,   d k / d logp = 1 - exp(r).
#pragma once

#include <span>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::rl {

struct AdvantageOptions {
  bool normalize_std = true;  // false: Dr. GRPO
  double eps = 1e-6;
};

// One group's rewards -> each sample's advantage. InvalidArgument naming the sample when a
// reward is not finite (a reward function's NaN would otherwise reach every gradient).
Result<std::vector<double>> group_advantages(std::span<const double> rewards,
                                             const AdvantageOptions& o);

struct PolicyLossOptions {
  double clip_low = 0.2;    // eps_low
  double clip_high = 0.28;  // eps_high (DAPO's clip-higher)
  double tis_cap = 2.0;     // C; 0: no importance weight (w = 1)
  double kl_coef = 0.0;     // beta; 0: no KL term (and no reference forward pass)
};

struct TokenTerm {
  double loss = 0;       // l / tokens
  double coef = 0;       // -d (l / tokens) / d logp
  double ratio = 1;      // u
  double is_weight = 1;  // w
  bool clipped = false;  // the clipped term was the minimum (no gradient)
};

// The term of one completion token, over `tokens` completion tokens in the global batch.
TokenTerm policy_token(double logp, double logp_old, double logp_mu, double advantage,
                       double tokens, const PolicyLossOptions& o);

struct KlTerm {
  double kl = 0;    // k3 of the token
  double loss = 0;  // beta * k / tokens
  double coef = 0;  // -d loss / d logp
};
KlTerm kl_token(double logp, double logp_ref, double tokens, double beta);

}  // namespace wl::rl
