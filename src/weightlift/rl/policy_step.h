// The trainer's side of a policy-gradient step: sampled completions become rows of a token
// batch, and one optimizer step minimises the policy loss (policy_loss.h) over them, on any
// layout of one pipeline stage: data, tensor and expert parallel (parallel/data/step.h's
// compute_gradients with a loss of our own).
//
// Row i of the batch is prompt_i + completion_i, padded with the end token to `seq`; its
// targets are the next token at every position whose next token is a completion token, and
// ignored elsewhere (the prompt and the padding carry no gradient). Position t's target is
// completion token j, sampled with log-probability logp_mu_j by the rollout worker.
//
// One optimizer step per batch (on-policy, as GRPO with one PPO epoch): pi_old is the policy the
// step starts from, so the trainer's own log-probability of each token is both logp and logp_old
// (the ratio is 1 and the clip cannot bite on this first pass), and the importance weight
// corrects for whatever separates the sampler from the trainer: rounding of the weights the
// workers hold, a staler version in asynchronous mode. The statistics say how large that was.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/rl/policy_loss.h"
#include "weightlift/train/data.h"

namespace wl::rl {

// One sampled completion and what the trainer needs of it.
struct Sample {
  std::vector<int64_t> prompt;      // token ids
  std::vector<int64_t> completion;  // sampled tokens, the end token last if it was produced
  std::vector<double> logprobs;     // per completion token, under the distribution sampled from
  uint64_t version = 0;             // the weights' version that produced it
  // The experts the rollout's router chose for every token it fed through the model (the
  // prompt, then the completion but its last token), [tokens][num_layers][top_k], a slot the
  // rollout dropped over capacity as kernels::dropped_route(expert); empty when the rollout
  // did not record them. The trainer replays them (routing replay, R3), drops included.
  std::vector<int32_t> routes;
  double reward = 0;
  double advantage = 0;
};

struct PolicyBatch {
  train::Batch batch;             // [rows, seq]
  std::vector<double> logp_mu;    // [rows * seq]: at a target position, the sampler's logprob
  std::vector<double> advantage;  // [rows * seq]
  // [rows * seq]: the reference policy's logprob of each target, when the loss has a KL term
  // (target_logprobs of the reference model); empty otherwise.
  std::vector<double> logp_ref;
  int64_t completion_tokens = 0;  // targets that count
  // [rows * seq, route_width]: the samples' routes at their positions, -1 at padding; empty
  // when the samples carry none.
  std::vector<int32_t> routes;
};

// InvalidArgument when a sample does not fit in `seq` tokens, has no completion, or its
// logprobs do not match its completion; or, when some sample has routes, when a sample's are
// not `route_width` (num_layers * top_k) per token fed, name an expert twice for a token or
// outside [0, experts) in a MoE layer, or name any in a dense layer (whose entries are -1).
struct RouteShape {
  int64_t width = 0;                  // num_layers * top_k
  int64_t top_k = 1;                  // entries per token and layer
  int64_t experts = 0;                // valid experts are [0, experts)
  std::vector<int64_t> dense_layers;  // ascending: layers without a router
};
// The route shape of model `c`'s passes.
RouteShape route_shape(const model::ModelConfig& c);
Result<PolicyBatch> make_policy_batch(std::span<const Sample> samples, int64_t seq,
                                      const RouteShape& routes = {});

// Supervised fine-tuning rows (demonstrations): the same rows with the cross-entropy on the
// completion tokens only; train with parallel::run_step.
Result<train::Batch> make_sft_batch(std::span<const Sample> demonstrations, int64_t seq);

struct PolicyStats {
  double loss = 0;              // the policy loss (token mean)
  double aux = 0, z = 0;        // the router's losses, as in pretraining
  int64_t tokens = 0;           // completion tokens trained on
  double clip_fraction = 0;     // of tokens whose clipped term won (0 on a first pass)
  double is_weight_mean = 0;    // mean truncated importance weight
  double is_weight_capped = 0;  // fraction of tokens whose weight hit the cap
  double logprob_gap_mean = 0;  // mean |logp_trainer - logp_sampler| over tokens
  double logprob_gap_max = 0;   // the largest
  double kl_mean = 0;           // mean k3 estimate of KL(policy || reference) over tokens
  // Routing replay: the share of token-layers (over the whole batch's fed tokens) whose
  // replayed experts were not the ones the trainer's router would have chosen.
  double replay_differ = 0;
  // With a capacity factor: the share of the step's routing slots dropped over expert
  // capacity (train::drop_rate); NaN when routing is dropless.
  double drop_rate = NAN;
  train::StepReport report;  // the optimizer's
};

// Collective over the trainer's ranks (every rank passes the same batch), on any layout: data,
// tensor and expert parallel, and through pipeline stages. The loss is normalised by the batch's
// completion tokens, so it and its gradients do not depend on the micro-batching or the number of
// ranks.
//
// policy_gradients leaves the gradients summed over the ranks (DataParallel::gather_grads
// reads them) and `report` empty; policy_step also applies the optimizer.
// Every target's log-probability under dp's current weights (forward only, the whole batch on
// every rank: collective where parameters are sharded), 0 where the target is ignored. With
// `routes` (PolicyBatch::routes, not empty) every token goes to its recorded experts and drops
// what they dropped, as the policy step replays them. One pipeline stage only (pp 1).
Result<std::vector<double>> target_logprobs(parallel::DataParallel& dp, const train::Batch& batch,
                                            std::span<const int32_t> routes = {});

Result<PolicyStats> policy_gradients(parallel::DataParallel& dp, const PolicyBatch& batch,
                                     const parallel::StepSettings& settings,
                                     const PolicyLossOptions& options);
Result<PolicyStats> policy_step(parallel::DataParallel& dp, const PolicyBatch& batch,
                                const parallel::StepSettings& settings,
                                const PolicyLossOptions& options);

}  // namespace wl::rl
