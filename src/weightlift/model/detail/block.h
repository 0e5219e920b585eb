// One transformer block, forward and backward. Internal to the model layer.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "weightlift/core/tensor.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/kernels/router.h"
#include "weightlift/model/config.h"
#include "weightlift/model/expert_exchange.h"
#include "weightlift/model/params.h"
#include "weightlift/model/precision.h"
#include "weightlift/model/tensor_parallel.h"
#include "weightlift/model/weight_copies.h"

namespace wl::model::detail {

class WeightGradients;

// An f32 tensor for a pass's activations and scratch (uninitialised).
inline Tensor f32(Shape s) { return Tensor::empty(DType::kF32, std::move(s)); }

struct BlockDims {
  int64_t batch, seq, tokens;  // tokens = batch * seq
};

// Everything the backward pass of one block needs. Under gradient checkpointing only `x`
// survives the forward pass; the rest is recomputed from it.
struct BlockActs {
  Tensor x;               // [N, d] block input
  Tensor xn1, rstd1;      // [N, d], [N]: attn_norm
  Tensor q, k, v;         // [N, H*Dh], [N, Hkv*Dh], [N, Hkv*Dh]; q and k after RoPE
  Tensor q_raw, k_raw;    // with qk_norm: q and k before their norms
  Tensor rstd_q, rstd_k;  // [N*H], [N*Hkv]
  Tensor att, lse;        // [N, H*Dh] heads concatenated, [B, H, T]
  Tensor h;               // [N, d] = x + att @ Wo^T
  Tensor xn2, rstd2;      // [N, d], [N]: moe_norm
  // A dense layer's MLP uses xn2, he [N, 2Fd] and ae [N, Fd] below, and none of the rest.
  Tensor probs, topk_w, lse_r;  // [N, E], [N, K], [N]
  Tensor topk_idx;              // [N, K] i32
  // [N, K] u8 under routing replay: 1 for a slot the replayed routes drop (another pass's
  // drops over capacity, replayed instead of this pass's own capacity); empty otherwise.
  Tensor replay_drops;
  Tensor counts;  // [E] i64: slots per expert, of these tokens
  // The router's statistics for the aux and z losses: slots per expert and tokens over every
  // rank sharing this micro-batch (data parallel); `counts` and N on one rank. Kept under
  // gradient checkpointing so the recomputed forward needs no second sum.
  Tensor group_counts;  // [E] i64
  int64_t group_tokens = 0;
  // Dispatch: rows of the expert buffers grouped by expert, in token order within each.
  // Without BlockContext::keep every slot has a row (N*K of them); with it, only the kept
  // tokens' slots, the others' row being -1.
  std::vector<int64_t> expert_begin;  // [E + 1] first row of each expert
  Tensor row_of_slot;                 // [N, K] i32: the expert-buffer row of token t's k-th choice
  Tensor token_of_row;                // [N*K] i32 (its first expert_begin[E] entries used)
  // The rows this rank's experts ran: [R, d] inputs, [R, 2F] gate_up outputs, [R, F] SwiGLU
  // outputs, expert first_run + i running rows [run_begin[i], run_begin[i + 1]). In one
  // process those are the dispatched rows (R = expert_begin[E], every expert). Under expert
  // parallelism they are what the exchange brought, expert by expert, each expert's rows in rank
  // order; run_from[i * runs + j] rows of the run's expert j came from rank i.
  Tensor xe, he, ae;
  int64_t first_run = 0;
  std::vector<int64_t> run_begin;
  std::vector<int64_t> run_from;
  Tensor ye;  // [expert_begin[E], d]: each dispatched row's expert output

  bool complete() const { return xn1.raw() != nullptr; }  // false after keep_only_input()
  void keep_only_input();  // drop everything but x and the group statistics
};

struct BlockContext {
  const ModelConfig& config;
  const kernels::RopeTable& rope;
  Precision precision;
  int layer = -1;  // the model's layer this block is
  // The step's bf16 weight copies (weight_copies.h); null: each Linear converts its weight.
  WeightCopies* weight_copies = nullptr;
  // Sums the router's slot counts [E] over the ranks sharing this micro-batch, in place, and
  // returns the tokens they route; empty on one rank.
  std::function<int64_t(int64_t* counts, int64_t tokens)> sum_router_counts;
  // A gradient-checkpointing rerun of a forward pass whose group statistics are in the acts.
  bool recompute = false;
  // Routing replay: token t goes to the experts at replay[t * route_stride] instead of the
  // router's top-k (kernels::router_replay); null: the top-k.
  const int32_t* replay = nullptr;
  // When not null, receives the experts token t went to at routes_out[t * route_stride], and
  // replay_differ the tokens whose replayed experts were not the router's own choice.
  int32_t* routes_out = nullptr;
  int64_t* replay_differ = nullptr;
  int64_t route_stride = 0;
  // Expert parallelism: this rank runs only its run of the experts, over the rows every rank
  // of the exchange sends it (expert_exchange.h); null: every expert, here.
  ExpertExchange* experts = nullptr;
  // Tensor parallelism: the block runs one rank's heads and ffn rows (the config is that
  // rank's tp_config) and sums over the TP group (tensor_parallel.h); null: the whole block.
  TensorParallel* tp = nullptr;
  // keep[t] == 0: nothing reads token t's output (the last block before a head that computes
  // only the positions with a target), so its experts do not run: its output is the residual
  // h alone, and its slots get no rows. The router still routes it, for the aux and z losses
  // and the recorded routes. Null: every token.
  const uint8_t* keep = nullptr;
  // Token dropping (kernels::expert_capacity): each expert takes at most capacity_factor
  // times its even share of this pass's slots; 0: every slot (dropless). Training passes and
  // model::generate use the config's (none when they replay routes, which carry their drops).
  // The rollout engines (infer/worker.h) drop by the config's, their own way.
  double capacity_factor = 0;
  // Zero-bubble pipelines: the backward's weight gradients are added here, to run later,
  // instead of at once (linear.h). Null: at once.
  WeightGradients* weight_grads = nullptr;
};

// Fills acts (acts.x must hold the input) and writes the block output to out [N, d].
// Adds this layer's aux_l and z_l (unweighted), its slots and those dropped to *losses.
void block_forward(const BlockContext& ctx, const BlockDims& dims, const LayerView& w,
                   BlockActs& acts, float* out, kernels::RouterLosses* losses);

// The MLP half on its own: in an MoE layer routes a.xn2 [N, d] (already normed), fills the
// router and expert fields of `a`, and writes out = h + MoE(a.xn2); in a dense layer
// out = h + SwiGLU(a.xn2). Generation calls it with N new tokens.
void moe_forward(const BlockContext& ctx, const LayerView& w, int64_t tokens, BlockActs& acts,
                 const float* h, float* out, kernels::RouterLosses* losses);

struct BlockGradScales {
  float aux = 0;  // d loss / d aux_l
  float z = 0;    // d loss / d z_l
};

// dout [N, d] is d loss / d block output; writes d loss / d block input into dx [N, d]
// (dx may alias dout) and adds weight gradients into g.
void block_backward(const BlockContext& ctx, const BlockDims& dims, const LayerView& w,
                    const LayerView& g, const BlockActs& acts, const float* dout, float* dx,
                    const BlockGradScales& scales);

}  // namespace wl::model::detail
