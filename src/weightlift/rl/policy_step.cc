// policy_step.h.
#include "weightlift/rl/policy_step.h"

#include <algorithm>
#include <cmath>

#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/kernels/router.h"
#include "weightlift/parallel/pipeline/pipeline.h"
#include "weightlift/train/metrics.h"
#include "weightlift/train/tokenizer.h"

namespace wl::rl {
namespace {

// Lays sample i out as row i; `at(i, t, j)` hears of every target position t (completion token
// j is its target).
template <typename At>
Result<train::Batch> lay_out(std::span<const Sample> samples, int64_t seq, At at) {
  train::Batch b;
  b.batch = int64_t(samples.size());
  b.seq = seq;
  b.tokens.assign(size_t(b.batch * seq), train::kEosToken);
  b.targets.assign(size_t(b.batch * seq), kernels::kIgnoreIndex);
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    const int64_t p = int64_t(s.prompt.size()), c = int64_t(s.completion.size());
    if (p == 0 || c == 0) {
      return invalid_argument("sample " + std::to_string(i) + ": " +
                              (p == 0 ? "empty prompt" : "empty completion"));
    }
    // The last completion token is a target, never an input.
    if (p + c - 1 > seq) {
      return invalid_argument("sample " + std::to_string(i) + ": " + std::to_string(p) + " + " +
                              std::to_string(c) + " tokens do not fit in " + std::to_string(seq) +
                              " positions and a target");
    }
    int64_t* row = b.tokens.data() + i * seq;
    int64_t* target = b.targets.data() + i * seq;
    std::copy(s.prompt.begin(), s.prompt.end(), row);
    std::copy(s.completion.begin(), s.completion.end() - 1, row + p);
    for (int64_t j = 0; j < c; ++j) {
      target[p - 1 + j] = s.completion[size_t(j)];
      at(i, (p - 1 + j), j);
    }
  }
  return b;
}

}  // namespace

namespace {

// Sample i's routes, checked against `shape`, laid out at row i of `out` [rows * seq, width].
Status lay_out_routes(const Sample& s, size_t i, int64_t seq, const RouteShape& shape,
                      std::vector<int32_t>& out) {
  const std::string where = "sample " + std::to_string(i) + ": routes: ";
  const size_t fed = s.prompt.size() + s.completion.size() - 1;
  if (shape.width <= 0 || shape.top_k <= 0 || shape.width % shape.top_k != 0) {
    return invalid_argument(where + "no route shape for the batch (width " +
                            std::to_string(shape.width) + ", top_k " + std::to_string(shape.top_k) +
                            ")");
  }
  if (s.routes.size() != fed * size_t(shape.width)) {
    return invalid_argument(where + std::to_string(s.routes.size()) + " entries for " +
                            std::to_string(fed) + " tokens fed of " + std::to_string(shape.width) +
                            " each");
  }
  // Each entry of a MoE layer an expert, or one dropped over capacity (kernels::dropped_route);
  // a dense layer's -1.
  const size_t K = size_t(shape.top_k);
  for (size_t e = 0; e < s.routes.size(); e += K) {
    const size_t token = e / size_t(shape.width), layer = e % size_t(shape.width) / K;
    const bool dense =
        std::binary_search(shape.dense_layers.begin(), shape.dense_layers.end(), int64_t(layer));
    for (size_t j = 0; j < K; ++j) {
      const int32_t x = kernels::route_expert(s.routes[e + j]);
      bool twice = false;
      for (size_t before = 0; before < j; ++before) {
        twice = twice || kernels::route_expert(s.routes[e + before]) == x;
      }
      const bool bad =
          dense ? s.routes[e + j] != -1 : s.routes[e + j] == -1 || x >= shape.experts || twice;
      if (bad) {
        return invalid_argument(where + "token " + std::to_string(token) + ", layer " +
                                std::to_string(layer) + ": expert " +
                                std::to_string(s.routes[e + j]) +
                                (dense   ? " in a dense layer (no router; -1 expected)"
                                 : twice ? " twice"
                                         : " outside [0, " + std::to_string(shape.experts) + ")"));
      }
    }
  }
  std::copy(s.routes.begin(), s.routes.end(),
            out.begin() + int64_t(i * size_t(seq) * size_t(shape.width)));
  return ok_status();
}

}  // namespace

RouteShape route_shape(const model::ModelConfig& c) {
  return {.width = c.num_layers * c.top_k,
          .top_k = c.top_k,
          .experts = c.num_experts,
          .dense_layers = c.dense_layers};
}

Result<PolicyBatch> make_policy_batch(std::span<const Sample> samples, int64_t seq,
                                      const RouteShape& routes) {
  PolicyBatch out;
  out.logp_mu.assign(samples.size() * size_t(seq), 0.0);
  out.advantage.assign(samples.size() * size_t(seq), 0.0);
  for (size_t i = 0; i < samples.size(); ++i) {
    if (samples[i].logprobs.size() != samples[i].completion.size()) {
      return invalid_argument("sample " + std::to_string(i) + ": " +
                              std::to_string(samples[i].logprobs.size()) + " logprobs for " +
                              std::to_string(samples[i].completion.size()) + " tokens");
    }
  }
  WL_ASSIGN_OR_RETURN(out.batch, lay_out(samples, seq, [&](size_t i, int64_t t, int64_t j) {
                        const size_t at = i * size_t(seq) + size_t(t);
                        out.logp_mu[at] = samples[i].logprobs[size_t(j)];
                        out.advantage[at] = samples[i].advantage;
                        ++out.completion_tokens;
                      }));
  const bool any = std::any_of(samples.begin(), samples.end(),
                               [](const Sample& s) { return !s.routes.empty(); });
  if (any) {
    out.routes.assign(samples.size() * size_t(seq) * size_t(routes.width), -1);
    for (size_t i = 0; i < samples.size(); ++i) {
      WL_RETURN_IF_ERROR(lay_out_routes(samples[i], i, seq, routes, out.routes));
    }
  }
  return out;
}

Result<train::Batch> make_sft_batch(std::span<const Sample> demonstrations, int64_t seq) {
  return lay_out(demonstrations, seq, [](size_t, int64_t, int64_t) {});
}

namespace {

// Routing replay: the settings route every token to the batch's recorded experts and count
// in *differ the token-layers the model's own router would have routed differently. Returns
// how many token-layers are replayed: zero for a batch without routes.
Result<int64_t> replay_routes(const model::ModelConfig& c, const PolicyBatch& b,
                              parallel::StepSettings& s, int64_t* differ) {
  if (b.routes.empty()) return int64_t{0};
  const size_t width = size_t(c.num_layers * c.top_k);
  if (b.routes.size() != b.batch.tokens.size() * width) {
    return invalid_argument(
        "routing replay: " + std::to_string(b.routes.size()) + " route entries for " +
        std::to_string(b.batch.tokens.size()) + " positions of " + std::to_string(width) + " (" +
        std::to_string(c.num_layers) + " layers x top_k " + std::to_string(c.top_k) + ")");
  }
  // A token is replayed unless it is padding: its entries are -1 in every layer, and a
  // first slot dropped over capacity is still replayed. Dense layers route nothing.
  int64_t first_moe = 0;
  while (first_moe < c.num_layers && c.dense_layer(first_moe)) ++first_moe;
  if (first_moe == c.num_layers) return int64_t{0};
  int64_t routed = 0;
  for (size_t at = size_t(first_moe * c.top_k); at < b.routes.size(); at += width) {
    routed += b.routes[at] != -1;
  }
  s.replay_routes = b.routes.data();
  s.replay_differ = differ;
  return routed * c.moe_layers();
}

// The policy loss of `b` as the step's micro-batch loss: each target's term and coefficient
// (policy_loss.h, and the KL term when it has one), its statistics added into `sums`
// (clipped, weight, capped, gap, KL) and the largest gap into *gap_max.
parallel::MicroBatchLoss micro_batch_loss(const PolicyBatch& b, const PolicyLossOptions& options,
                                          double* sums, double* gap_max) {
  const int64_t seq = b.batch.seq;
  const double tokens = double(std::max<int64_t>(b.completion_tokens, 1));
  const bool kl = options.kl_coef > 0;
  return {.part =
              [&b, &options, sums, gap_max, seq, tokens, kl](model::StagePass& pass,
                                                             parallel::RowRange rows) {
                const size_t first = size_t(rows.begin * seq);
                return pass.token_loss(
                    b.batch.targets.data() + first,
                    [&](std::span<const double> logp, std::span<float> coef) {
                      double part = 0;
                      for (size_t r = 0; r < logp.size(); ++r) {
                        if (b.batch.targets[first + r] == kernels::kIgnoreIndex) continue;
                        const double mu = b.logp_mu[first + r];
                        const TokenTerm t = policy_token(logp[r], logp[r], mu,
                                                         b.advantage[first + r], tokens, options);
                        double c = t.coef;
                        part += t.loss;
                        if (kl) {
                          const KlTerm k =
                              kl_token(logp[r], b.logp_ref[first + r], tokens, options.kl_coef);
                          c += k.coef;
                          part += k.loss;
                          sums[4] += k.kl;
                        }
                        coef[r] = float(c);
                        sums[0] += t.clipped;
                        sums[1] += t.is_weight;
                        sums[2] += options.tis_cap > 0 && t.is_weight >= options.tis_cap;
                        const double gap = std::fabs(logp[r] - mu);
                        sums[3] += gap;
                        *gap_max = std::max(*gap_max, gap);
                      }
                      return part;
                    });
              },
          .divisor = 1};
}

}  // namespace

Result<PolicyStats> policy_gradients(parallel::DataParallel& dp, const PolicyBatch& b,
                                     const parallel::StepSettings& settings,
                                     const PolicyLossOptions& options) {
  const double tokens = double(std::max<int64_t>(b.completion_tokens, 1));
  if (options.kl_coef > 0 && b.logp_ref.size() != b.logp_mu.size()) {
    return invalid_argument("the loss has a KL term (beta " + std::to_string(options.kl_coef) +
                            ") but the batch has " + std::to_string(b.logp_ref.size()) +
                            " reference log-probabilities for " + std::to_string(b.logp_mu.size()) +
                            " positions");
  }
  // Summed over this rank's micro-batches, then over the ranks: clipped, weight, capped,
  // gap, KL, and (separately) the largest gap.
  double sums[5] = {0, 0, 0, 0, 0};
  double gap_max = 0;
  const parallel::MicroBatchLoss loss = micro_batch_loss(b, options, sums, &gap_max);
  PolicyStats st;
  parallel::StepSettings s = settings;
  int64_t differ = 0;  // token-layers the step's own router would have routed differently
  WL_ASSIGN_OR_RETURN(const int64_t routed, replay_routes(dp.config(), b, s, &differ));
  const parallel::ParallelLayout& layout = dp.options().layout;
  WL_ASSIGN_OR_RETURN(
      model::LossTerms lt,
      layout.pp > 1 ? parallel::compute_pipeline_gradients(dp, b.batch, s, layout.schedule, loss)
                    : parallel::compute_gradients(dp, b.batch, s, loss));
  // Over the replica: under pipeline parallelism the last stage alone has the token terms,
  // and each stage its own layers' replayed routes.
  double replayed = double(differ);
  WL_RETURN_IF_ERROR(dp.sum_over_replica(&replayed, 1));
  st.replay_differ = routed > 0 ? replayed / double(routed) : 0.0;
  WL_RETURN_IF_ERROR(dp.sum_over_replica(sums, 5));
  // The largest gap over the ranks: a sum of one-hot vectors would do, a max of the negated
  // sums would not; ranks are few, so each contributes its max in its own slot.
  std::vector<double> maxes(size_t(dp.ranks()), 0.0);
  maxes[size_t(dp.rank())] = gap_max;
  WL_RETURN_IF_ERROR(dp.sum_over_replica(maxes.data(), maxes.size()));
  st.loss = lt.ce;
  st.aux = lt.aux;
  st.z = lt.z;
  st.drop_rate = train::drop_rate(dp.config().capacity_factor, lt.slots, lt.dropped);
  st.tokens = b.completion_tokens;
  st.clip_fraction = sums[0] / tokens;
  st.is_weight_mean = sums[1] / tokens;
  st.is_weight_capped = sums[2] / tokens;
  st.logprob_gap_mean = sums[3] / tokens;
  st.logprob_gap_max = *std::max_element(maxes.begin(), maxes.end());
  st.kl_mean = sums[4] / tokens;
  return st;
}

Result<std::vector<double>> target_logprobs(parallel::DataParallel& dp, const train::Batch& b,
                                            std::span<const int32_t> routes) {
  if (dp.options().layout.pp != 1) {
    return invalid_argument("target_logprobs runs on one pipeline stage only (pp 1)");
  }
  std::vector<double> out(b.targets.size(), 0.0);
  dp.set_evaluating(true);
  model::StagePass pass(
      dp.pass_model(), {0, dp.units().head()}, b.tokens.data(), b.batch, b.seq,
      {.targets = b.targets.data(), .replay_routes = routes.empty() ? nullptr : routes.data()},
      &dp);
  const Status forward = pass.forward(nullptr, false);
  if (forward.ok()) {
    pass.token_loss(b.targets.data(), [&](std::span<const double> logp, std::span<float>) {
      for (size_t r = 0; r < logp.size(); ++r)
        if (b.targets[r] != kernels::kIgnoreIndex) out[r] = logp[r];
      return 0.0;
    });
  }
  dp.set_evaluating(false);
  WL_RETURN_IF_ERROR(forward);
  return out;
}

Result<PolicyStats> policy_step(parallel::DataParallel& dp, const PolicyBatch& b,
                                const parallel::StepSettings& settings,
                                const PolicyLossOptions& options) {
  WL_ASSIGN_OR_RETURN(PolicyStats st, policy_gradients(dp, b, settings, options));
  const bool f16 = settings.precision == model::Precision::kF16;
  WL_ASSIGN_OR_RETURN(st.report,
                      dp.apply_optimizer(settings.lr, f16 ? 1.0 / settings.loss_scale : 1.0));
  return st;
}

}  // namespace wl::rl
