// MoE router: softmax over experts in f32, top-k selection, gate weights, and the two
// auxiliary losses of DESIGN.md (load balancing and router z-loss) for one layer.
#pragma once

#include <cstdint>

namespace wl::kernels {

struct RouterShape {
  int64_t tokens = 0;
  int64_t experts = 0;
  int64_t top_k = 0;
  bool norm_topk = true;  // gate weights divided by the sum of the selected probabilities
  // The tokens the aux and z losses average over: this micro-batch's on every data-parallel
  // rank, when the micro-batch is spread over several (the counts passed to router_losses and
  // router_backward are then summed over them too). 0: `tokens`, one rank.
  int64_t group_tokens = 0;
  int64_t loss_tokens() const { return group_tokens > 0 ? group_tokens : tokens; }
  // Slots each expert takes (expert_capacity()); the slots past it are dropped by
  // group_by_expert. 0: every slot (dropless).
  int64_t capacity = 0;
};

// Switch Transformer's expert capacity with top_k slots per token, as GShard counts them:
// ceil(factor * tokens * top_k / experts), computed in double in that order (factor times the
// slots, then divided by the experts) so that the reference computes the same integer.
int64_t expert_capacity(double factor, int64_t tokens, int64_t top_k, int64_t experts);

// logits: [tokens, experts]. Writes probs [tokens, experts] = softmax(logits),
// topk_idx [tokens, top_k] (experts by descending probability; equal probabilities go to the
// lower index), topk_w [tokens, top_k] gate weights, and lse [tokens] = logsumexp(logits)
// (may be null). counts [experts] (may be null) receives how many slots went to each expert.
void router_forward(const RouterShape& s, const float* logits, float* probs, int32_t* topk_idx,
                    float* topk_w, float* lse, int64_t* counts);

// A routing slot as recorded routes hold it (routing replay): its expert e when the slot ran,
// -2 - e when expert e had no room for it (dropped over capacity, the token passing through
// the residual), -1 where nothing was routed (padding).
inline int32_t dropped_route(int32_t expert) { return -2 - expert; }
inline bool route_dropped(int32_t entry) { return entry <= -2; }
inline int32_t route_expert(int32_t entry) { return entry >= 0 ? entry : -2 - entry; }

// Routing replay (R3): the experts of `routes` instead of the top-k, for every token whose
// first entry is not -1 (routes [tokens] rows of top_k entries as above, `route_stride` apart;
// a token with -1 first keeps router_forward's choice). Rewrites topk_idx, topk_w (the
// router's probabilities at the given experts, normalised as router_forward does, so the
// router keeps its gradient through them) and counts; `drops` [tokens * top_k] (may be null)
// receives 1 for each slot the routes mark dropped, 0 elsewhere. The experts must be distinct
// and in [0, experts) (checked by whoever received them). Returns how many tokens' replayed
// experts differ, as a set, from the router's own top-k.
int64_t router_replay(const RouterShape& s, const float* probs, const int32_t* routes,
                      int64_t route_stride, int32_t* topk_idx, float* topk_w, int64_t* counts,
                      uint8_t* drops = nullptr);

struct RouterLosses {
  double aux = 0;  // experts * sum_i f_i * P_i, this layer, before aux_loss_alpha
  double z = 0;    // mean over tokens of lse^2, this layer, before z_loss_beta
  // The slots routed (tokens * top_k) and those dropped over capacity; summed over layers like
  // aux and z, so their ratio is the drop rate. Counted where the losses are.
  int64_t slots = 0;
  int64_t dropped = 0;
};

// f_i = counts[i] / (T * top_k); P_i = (sum over tokens of probs[:, i]) / T, T = loss_tokens().
// With the micro-batch spread over ranks, each rank's result is its share: the ranks' results
// add up to the losses of the whole micro-batch (f is theirs, P and z are sums over tokens).
RouterLosses router_losses(const RouterShape& s, const float* probs, const float* lse,
                           const int64_t* counts);

struct RouterBackwardArgs {
  const float* probs = nullptr;       // [tokens, experts] from forward
  const int32_t* topk_idx = nullptr;  // [tokens, top_k]
  const float* topk_w = nullptr;      // [tokens, top_k]
  const float* lse = nullptr;         // [tokens]; needed when z_scale != 0
  const int64_t* counts = nullptr;    // [experts], over loss_tokens(); needed when aux_scale != 0
  const float* dtopk_w = nullptr;     // [tokens, top_k]: d loss / d gate weights
  // d loss / d aux_l and d loss / d z_l: aux_loss_alpha / num_layers and
  // z_loss_beta / num_layers times the loss's own scale (1 unless loss scaling).
  float aux_scale = 0;
  float z_scale = 0;
  float* dlogits = nullptr;  // [tokens, experts], overwritten
};

// Backward through gate weights (and their normalisation), the softmax, the aux loss (f_i
// carries no gradient) and the z-loss.
void router_backward(const RouterShape& s, const RouterBackwardArgs& a);

// The dispatch the trainer and the inference worker share: the routing slots as rows grouped
// by expert, token order within an expert (so each expert runs one GEMM over contiguous rows).
// From topk_idx [tokens, top_k]: expert_begin [experts + 1] (expert e's rows are [begin[e],
// begin[e + 1])), row_of_slot [tokens * top_k] (slot t * top_k + k's row) and token_of_row
// [tokens * top_k]. A slot without a row gets row -1: with `keep`, every slot of a token with
// keep[t] == 0, and with s.capacity, the slots an expert has no room for. An expert fills its
// capacity as GShard does: every token's first choice in token order, then every second
// choice, and so on, so a token loses its later choices first. A token left out by `keep`
// still takes its place (the slots kept are those of running every token), and *dropped (when
// not null) receives the slots dropped. Returns the rows.
//
// `drops.given` [tokens * top_k] drops the slots marked 1 as well, before capacity and without
// taking any (a replay of another pass's drops); `drops.marks` [tokens * top_k] receives 1 for
// every slot dropped, given or for capacity, and 0 for the others (a slot left out by `keep`
// alone is not dropped).
struct SlotDrops {
  const uint8_t* given = nullptr;
  uint8_t* marks = nullptr;
};
int64_t group_by_expert(const RouterShape& s, const int32_t* topk_idx, const uint8_t* keep,
                        int64_t* expert_begin, int32_t* row_of_slot, int32_t* token_of_row,
                        int64_t* dropped = nullptr, const SlotDrops& drops = {});

}  // namespace wl::kernels
