/* MoE router: softmax over experts, top-k, gate weights, load-balancing and z losses.
 *
 * Forward, per token t over its expert logits l[t, :]:
 *   p = softmax(l) in f32 (max subtracted), lse = max + log(sum exp(l - max));
 *   top_k experts by descending p, equal p going to the lower index (a total order, so the
 *   choice does not depend on the selection algorithm);
 *   w_j = p[idx_j], divided by S = sum_j p[idx_j] when norm_topk.
 * With a handful of experts per token, k passes of "largest not yet taken" beat any sort.
 *
 * Losses of one layer (DESIGN.md): aux = E * sum_i f_i P_i with f_i = counts_i / (T k) and
 * P_i = mean_t p[t, i]; z = mean_t lse_t^2. Accumulated in double. T is the micro-batch's
 * token count over every data-parallel rank (RouterShape::loss_tokens), the counts its counts,
 * so P and z, sums over tokens, split into per-rank shares while f stays whole.
 *
 * Backward. With g = dL/dw (the gate weights' gradient), the gradient reaching p[t, :] is
 *   through the gates:   dp[idx_j] += g_j                       (no normalisation)
 *                        dp[idx_j] += (g_j - sum_l g_l w_l) / S   (norm_topk: w = p / S)
 *   through aux:         dp[i] += aux_scale * E * f_i / T       (f_i is a count: no gradient)
 * then the softmax Jacobian, dl[i] = p_i (dp_i - sum_j p_j dp_j), plus the z-loss term
 *   dz/dl[t, i] = 2 lse_t p[t, i] / T, times z_scale.
 * Rows are independent, so both passes run in parallel over tokens; per-row arithmetic is in
 * double (a few dozen values per token: free, and it keeps the gradient exact to f32).
 *
 * A capacity factor drops slots, not routing: f_i counts the router's choices, dropped or not
 * (as Switch Transformer's), and a dropped slot's gate weight keeps its place in S, so the
 * token's other slots weigh what they would have. The dropped slot's output is zero, hence so
 * is g_j there, and the gradient reaches p only through the normalisation and the losses.
 */
#include "weightlift/kernels/router.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace {

void check_shape(const RouterShape& s) {
  WL_CHECK(s.tokens >= 0 && s.experts > 0) << "tokens " << s.tokens << " experts " << s.experts;
  WL_CHECK(s.top_k > 0 && s.top_k <= s.experts) << "top_k " << s.top_k << " of " << s.experts;
}

// counts[e] = the slots of topk_idx [slots] that went to expert e.
void count_slots(const int32_t* topk_idx, int64_t slots, int64_t experts, int64_t* counts) {
  std::memset(counts, 0, size_t(experts) * sizeof(int64_t));
  for (int64_t i = 0; i < slots; ++i) ++counts[topk_idx[i]];
}

// Gate weights of one token: the probabilities at its experts idx [K], over their sum when
// norm_topk.
void gate_weights(const RouterShape& s, const float* p, const int32_t* idx, float* w) {
  float selected = 0;
  for (int64_t j = 0; j < s.top_k; ++j) {
    w[j] = p[idx[j]];
    selected += w[j];
  }
  if (s.norm_topk) {
    for (int64_t j = 0; j < s.top_k; ++j) w[j] /= selected;
  }
}

// Rows per parallel chunk: enough work per chunk to pay for waking a thread.
int64_t router_row_grain(int64_t experts) { return std::max<int64_t>(16, 4096 / experts); }

}  // namespace

void router_forward(const RouterShape& s, const float* logits, float* probs, int32_t* topk_idx,
                    float* topk_w, float* lse, int64_t* counts) {
  check_shape(s);
  const int64_t E = s.experts, K = s.top_k;
  parallel_for(s.tokens, router_row_grain(E), [&](int64_t t0, int64_t t1) {
    std::vector<char> taken(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = logits + t * E;
      float* p = probs + t * E;
      float mx = l[0];
      for (int64_t i = 1; i < E; ++i) mx = std::max(mx, l[i]);
      float sum = 0;
      for (int64_t i = 0; i < E; ++i) {
        p[i] = std::exp(l[i] - mx);
        sum += p[i];
      }
      const float inv = 1.0f / sum;
      for (int64_t i = 0; i < E; ++i) p[i] *= inv;
      if (lse) lse[t] = mx + std::log(sum);

      // k passes: the largest untaken probability, scanning upward so that an equal value
      // at a higher index never replaces the lower one (strict >).
      std::fill(taken.begin(), taken.end(), 0);
      int32_t* idx = topk_idx + t * K;
      for (int64_t j = 0; j < K; ++j) {
        int64_t best = -1;
        for (int64_t i = 0; i < E; ++i) {
          if (!taken[size_t(i)] && (best < 0 || p[i] > p[best])) best = i;
        }
        taken[size_t(best)] = 1;
        idx[j] = int32_t(best);
      }
      gate_weights(s, p, idx, topk_w + t * K);
    }
  });
  if (counts) count_slots(topk_idx, s.tokens * K, E, counts);
}

int64_t router_replay(const RouterShape& s, const float* probs, const int32_t* routes,
                      int64_t route_stride, int32_t* topk_idx, float* topk_w, int64_t* counts,
                      uint8_t* drops) {
  check_shape(s);
  const int64_t E = s.experts, K = s.top_k;
  if (drops) std::fill_n(drops, s.tokens * K, uint8_t(0));
  int64_t differ = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const int32_t* given = routes + t * route_stride;
    if (given[0] == -1) continue;
    int32_t* idx = topk_idx + t * K;
    bool same = true;
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = route_expert(given[j]);
      WL_CHECK(given[j] != -1 && e < E) << "token " << t << ": route entry " << given[j];
      same = same && std::find(idx, idx + K, e) != idx + K;
    }
    differ += same ? 0 : 1;
    for (int64_t j = 0; j < K; ++j) {
      idx[j] = route_expert(given[j]);
      if (drops) drops[t * K + j] = route_dropped(given[j]) ? 1 : 0;
    }
    gate_weights(s, probs + t * E, idx, topk_w + t * K);
  }
  if (counts) count_slots(topk_idx, s.tokens * K, E, counts);
  return differ;
}

RouterLosses router_losses(const RouterShape& s, const float* probs, const float* lse,
                           const int64_t* counts) {
  check_shape(s);
  RouterLosses out;
  if (s.tokens == 0) return out;
  const int64_t E = s.experts;
  // Null counts (no aux) or null lse (z-loss off, lse not kept) leave that loss at 0.
  if (counts) {
    std::vector<double> sum_p(size_t(E), 0.0);
    for (int64_t t = 0; t < s.tokens; ++t) {
      for (int64_t i = 0; i < E; ++i) sum_p[size_t(i)] += probs[t * E + i];
    }
    const double T = double(s.loss_tokens());
    const double slots = T * double(s.top_k);
    double acc = 0;
    for (int64_t i = 0; i < E; ++i) acc += double(counts[i]) / slots * (sum_p[size_t(i)] / T);
    out.aux = double(E) * acc;
  }
  if (lse) {
    double acc = 0;
    for (int64_t t = 0; t < s.tokens; ++t) acc += double(lse[t]) * double(lse[t]);
    out.z = acc / double(s.loss_tokens());
  }
  return out;
}

void router_backward(const RouterShape& s, const RouterBackwardArgs& a) {
  check_shape(s);
  const int64_t E = s.experts, K = s.top_k, T = s.tokens;
  if (T == 0) return;
  WL_CHECK(a.probs && a.topk_idx && a.topk_w && a.dtopk_w && a.dlogits);
  WL_CHECK(a.aux_scale == 0 || a.counts) << "aux_scale " << a.aux_scale << " needs counts";
  WL_CHECK(a.z_scale == 0 || a.lse) << "z_scale " << a.z_scale << " needs lse";

  // The aux term of dp is the same for every token: aux_scale * E * f_i / T.
  const double Tg = double(s.loss_tokens());
  std::vector<double> aux_dp(size_t(E), 0.0);
  if (a.aux_scale != 0) {
    const double slots = Tg * double(K);
    for (int64_t i = 0; i < E; ++i) {
      aux_dp[size_t(i)] = double(a.aux_scale) * double(E) * (double(a.counts[i]) / slots) / Tg;
    }
  }
  const double z_coef = 2.0 * double(a.z_scale) / Tg;

  parallel_for(T, router_row_grain(E), [&](int64_t t0, int64_t t1) {
    std::vector<double> dp(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      const float* p = a.probs + t * E;
      const int32_t* idx = a.topk_idx + t * K;
      const float* w = a.topk_w + t * K;
      const float* g = a.dtopk_w + t * K;
      for (int64_t i = 0; i < E; ++i) dp[size_t(i)] = aux_dp[size_t(i)];
      if (s.norm_topk) {
        double sel = 0, gw = 0;
        for (int64_t j = 0; j < K; ++j) {
          sel += p[idx[j]];
          gw += double(g[j]) * double(w[j]);
        }
        for (int64_t j = 0; j < K; ++j) dp[size_t(idx[j])] += (double(g[j]) - gw) / sel;
      } else {
        for (int64_t j = 0; j < K; ++j) dp[size_t(idx[j])] += g[j];
      }
      double pdp = 0;
      for (int64_t i = 0; i < E; ++i) pdp += double(p[i]) * dp[size_t(i)];
      const double z = a.z_scale != 0 ? z_coef * double(a.lse[t]) : 0.0;
      float* dl = a.dlogits + t * E;
      for (int64_t i = 0; i < E; ++i) {
        dl[i] = float(double(p[i]) * (dp[size_t(i)] - pdp + z));
      }
    }
  });
}

int64_t expert_capacity(double factor, int64_t tokens, int64_t top_k, int64_t experts) {
  WL_CHECK(std::isfinite(factor) && factor > 0 && experts > 0)
      << "capacity factor " << factor << " over " << experts << " experts";
  return int64_t(std::ceil(factor * double(tokens * top_k) / double(experts)));
}

int64_t group_by_expert(const RouterShape& s, const int32_t* topk_idx, const uint8_t* keep,
                        int64_t* expert_begin, int32_t* row_of_slot, int32_t* token_of_row,
                        int64_t* dropped, const SlotDrops& drops) {
  const int64_t slots = s.tokens * s.top_k;
  // has_row[slot]: the slot runs. Given drops and capacity first (every token takes its
  // place), then `keep`.
  std::vector<uint8_t> has_row(size_t(slots), 1);
  int64_t over = 0;
  if (drops.given) {
    for (int64_t i = 0; i < slots; ++i) {
      if (drops.given[i]) {
        has_row[size_t(i)] = 0;
        ++over;
      }
    }
  }
  if (s.capacity > 0) {
    std::vector<int64_t> taken(size_t(s.experts), 0);
    for (int64_t k = 0; k < s.top_k; ++k) {
      for (int64_t t = 0; t < s.tokens; ++t) {
        const int64_t slot = t * s.top_k + k;
        if (!has_row[size_t(slot)]) continue;
        int64_t& n = taken[size_t(topk_idx[slot])];
        if (n < s.capacity) {
          ++n;
        } else {
          has_row[size_t(slot)] = 0;
          ++over;
        }
      }
    }
  }
  if (dropped) *dropped = over;
  if (drops.marks) {
    for (int64_t i = 0; i < slots; ++i) drops.marks[i] = has_row[size_t(i)] ? 0 : 1;
  }
  if (keep) {
    for (int64_t t = 0; t < s.tokens; ++t) {
      if (!keep[t]) std::fill_n(has_row.begin() + t * s.top_k, s.top_k, uint8_t(0));
    }
  }
  std::vector<int64_t> counts(size_t(s.experts), 0);
  for (int64_t i = 0; i < slots; ++i) {
    if (has_row[size_t(i)]) ++counts[size_t(topk_idx[i])];
  }
  expert_begin[0] = 0;
  for (int64_t e = 0; e < s.experts; ++e) expert_begin[e + 1] = expert_begin[e] + counts[size_t(e)];
  std::vector<int64_t> cursor(expert_begin, expert_begin + s.experts);
  for (int64_t i = 0; i < slots; ++i) {
    if (!has_row[size_t(i)]) {
      row_of_slot[i] = -1;
      continue;
    }
    const int64_t row = cursor[size_t(topk_idx[i])]++;
    row_of_slot[i] = int32_t(row);
    token_of_row[row] = int32_t(i / s.top_k);
  }
  return expert_begin[s.experts];
}

}  // namespace wl::kernels
