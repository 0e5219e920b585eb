// A block is x -> h = x + Attn(RMSNorm(x)) -> x + MoE(RMSNorm(h)) (DESIGN.md), written as
// the sequence of kernels the forward pass runs, and the backward pass that walks them in
// reverse. The MoE part dispatches tokens into per-expert row groups so each expert's
// SwiGLU is two GEMMs over contiguous rows ([n_e, d] x [d, 2F], then [n_e, F] x [F, d]).
// Under expert parallelism the rows go to their experts' ranks and back (expert_rows.h).
#include "weightlift/model/detail/block.h"

#include <algorithm>
#include <cstring>

#include "weightlift/core/parallel.h"
#include "weightlift/kernels/attention.h"
#include "weightlift/kernels/rmsnorm.h"
#include "weightlift/kernels/swiglu.h"
#include "weightlift/model/detail/expert_rows.h"
#include "weightlift/model/detail/linear.h"

namespace wl::model::detail {

void BlockActs::keep_only_input() {
  BlockActs kept;
  kept.x = x;
  kept.group_counts = group_counts;
  kept.group_tokens = group_tokens;
  *this = std::move(kept);
}

namespace {

struct Dims {
  int64_t d, H, Hkv, Dh, qd, kvd, qkvd, E, K, F, Fd;
  explicit Dims(const ModelConfig& c)
      : d(c.hidden_size),
        H(c.num_heads),
        Hkv(c.num_kv_heads),
        Dh(c.head_dim),
        qd(c.q_dim()),
        kvd(c.kv_dim()),
        qkvd(c.q_dim() + 2 * c.kv_dim()),
        E(c.num_experts),
        K(c.top_k),
        F(c.ffn_dim),
        Fd(c.dense_ffn_dim) {}
};

kernels::AttentionShape attention_shape(const Dims& m, const BlockDims& b) {
  return {.batch = b.batch,
          .seq_q = b.seq,
          .seq_kv = b.seq,
          .heads = m.H,
          .kv_heads = m.Hkv,
          .head_dim = m.Dh,
          .q_offset = 0};
}

// dst[n, width] = columns [col, col + width) of src[n, ld].
void gather_columns(float* dst, const float* src, int64_t n, int64_t ld, int64_t col,
                    int64_t width) {
  parallel_for(n, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(dst + i * width, src + i * ld + col, size_t(width) * 4);
  });
}

// Columns [col, col + width) of dst[n, ld] = src[n, width].
void scatter_columns(float* dst, const float* src, int64_t n, int64_t ld, int64_t col,
                     int64_t width) {
  parallel_for(n, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(dst + i * ld + col, src + i * width, size_t(width) * 4);
  });
}

// data[0, n) summed over the TP group; zeros where the sum failed (after_unit reports it).
void tp_sum(TensorParallel* tp, float* data, int64_t n) {
  if (tp && !tp->allreduce(data, n).ok()) std::memset(data, 0, size_t(n) * 4);
}

// The residual is added by one rank of a TP group: the sum of the partial outputs would
// count it once per rank.
bool adds_residual(const BlockContext& ctx) { return !ctx.tp || ctx.tp->rank() == 0; }

// The layer's weight `w` in `role` (expert `expert`'s, or -1), as the Linears take it.
Weight weight(const BlockContext& ctx, const float* w, ParamRole role, int64_t expert = -1) {
  return {w, ctx.weight_copies, {ctx.layer, role, int32_t(expert)}};
}

}  // namespace

namespace {

// The router over the normed input: probabilities, top-k, gate weights, counts, and the
// group statistics of the aux and z losses; the layer's share of those losses added into
// `losses` when given.
void route(const BlockContext& ctx, const Dims& m, const LayerView& w, int64_t N, BlockActs& a,
           kernels::RouterLosses* losses) {
  Tensor logits = f32({N, m.E});
  linear_forward(ctx.precision, a.xn2.data<float>(), weight(ctx, w.router, ParamRole::kRouter),
                 logits.data<float>(), N, m.d, m.E);
  a.probs = f32({N, m.E});
  a.topk_w = f32({N, m.K});
  a.lse_r = f32({N});
  a.topk_idx = Tensor::empty(DType::kI32, {N, m.K});
  a.counts = Tensor::empty(DType::kI64, {m.E});
  kernels::RouterShape rs{
      .tokens = N, .experts = m.E, .top_k = m.K, .norm_topk = ctx.config.norm_topk};
  kernels::router_forward(rs, logits.data<float>(), a.probs.data<float>(),
                          a.topk_idx.data<int32_t>(), a.topk_w.data<float>(), a.lse_r.data<float>(),
                          a.counts.data<int64_t>());
  a.replay_drops = Tensor();
  if (ctx.replay) {
    a.replay_drops = Tensor::empty(DType::kU8, {N, m.K});
    const int64_t differ = kernels::router_replay(
        rs, a.probs.data<float>(), ctx.replay, ctx.route_stride, a.topk_idx.data<int32_t>(),
        a.topk_w.data<float>(), a.counts.data<int64_t>(), a.replay_drops.data<uint8_t>());
    if (ctx.replay_differ && !ctx.recompute) *ctx.replay_differ += differ;
  }
  if (!ctx.recompute) {
    a.group_counts = a.counts.clone();
    a.group_tokens =
        ctx.sum_router_counts ? ctx.sum_router_counts(a.group_counts.data<int64_t>(), N) : N;
  }
  if (!losses) return;
  rs.group_tokens = a.group_tokens;
  const kernels::RouterLosses l = kernels::router_losses(
      rs, a.probs.data<float>(), a.lse_r.data<float>(), a.group_counts.data<int64_t>());
  losses->aux += l.aux;
  losses->z += l.z;
}

// Rows grouped by expert (kernels::group_by_expert: only the kept tokens' slots when `keep`,
// and each expert's first `capacity` when not 0, or the replayed drops), and their inputs
// gathered into xe. The routes out, when asked for, with the slots dropped marked
// (kernels::dropped_route). Returns the slots dropped.
int64_t dispatch(const BlockContext& ctx, const Dims& m, int64_t N, const uint8_t* keep,
                 int64_t capacity, BlockActs& a) {
  a.expert_begin.assign(size_t(m.E + 1), 0);
  a.row_of_slot = Tensor::empty(DType::kI32, {N, m.K});
  a.token_of_row = Tensor::empty(DType::kI32, {N * m.K});
  const kernels::RouterShape rs{.tokens = N, .experts = m.E, .top_k = m.K, .capacity = capacity};
  int64_t dropped = 0;
  const bool routes_out = ctx.routes_out && !ctx.recompute;
  std::vector<uint8_t> marks(routes_out ? size_t(N * m.K) : 0);
  const kernels::SlotDrops drops{
      .given = a.replay_drops.defined() ? a.replay_drops.data<uint8_t>() : nullptr,
      .marks = routes_out ? marks.data() : nullptr};
  const int64_t S = kernels::group_by_expert(rs, a.topk_idx.data<int32_t>(), keep,
                                             a.expert_begin.data(), a.row_of_slot.data<int32_t>(),
                                             a.token_of_row.data<int32_t>(), &dropped, drops);
  if (routes_out) {
    const int32_t* idx = a.topk_idx.data<int32_t>();
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t k = 0; k < m.K; ++k) {
        const int32_t e = idx[t * m.K + k];
        ctx.routes_out[t * ctx.route_stride + k] =
            marks[size_t(t * m.K + k)] ? kernels::dropped_route(e) : e;
      }
    }
  }
  a.xe = f32({S, m.d});
  const float* xn2 = a.xn2.data<float>();
  float* xe = a.xe.data<float>();
  const int32_t* token_of_row = a.token_of_row.data<int32_t>();
  parallel_for(S, 128, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(xe + r * m.d, xn2 + token_of_row[r] * m.d, size_t(m.d) * 4);
  });
  return dropped;
}

// The experts this rank runs, each SwiGLU MLP over its rows of a.xe (a.run_begin): fills a.he
// and a.ae, and returns the outputs [R, d].
Tensor run_experts(const BlockContext& ctx, const Dims& m, const LayerView& w, BlockActs& a) {
  const Precision p = ctx.precision;
  const int64_t R = a.xe.size(0);
  a.he = f32({R, 2 * m.F});
  a.ae = f32({R, m.F});
  Tensor y = f32({R, m.d});
  const int64_t runs = int64_t(a.run_begin.size()) - 1;
  WL_CHECK(w.holds_experts(a.first_run, runs))
      << "this rank runs experts [" << a.first_run << ", " << a.first_run + runs << ") but holds ["
      << w.first_expert << ", " << w.first_expert + w.held_experts << ")";
  for (size_t i = 0; i + 1 < a.run_begin.size(); ++i) {
    const int64_t r0 = a.run_begin[i], n = a.run_begin[i + 1] - r0;
    if (n == 0) continue;
    const int64_t e = a.first_run + int64_t(i);
    const float* gate_up = w.expert(e);           // [2F, d]
    const float* down = gate_up + 2 * m.F * m.d;  // [d, F]
    float* he = a.he.data<float>() + r0 * 2 * m.F;
    float* ae = a.ae.data<float>() + r0 * m.F;
    linear_forward(p, a.xe.data<float>() + r0 * m.d, weight(ctx, gate_up, ParamRole::kGate, e), he,
                   n, m.d, 2 * m.F);
    kernels::swiglu_forward(he, ae, n, m.F);
    linear_forward(p, ae, weight(ctx, down, ParamRole::kDown, e), y.data<float>() + r0 * m.d, n,
                   m.F, m.d);
  }
  return y;
}

// out = h + sum_k w[t, k] * ye[row(t, k)], slots in order; h null: 0.
void combine(const Dims& m, const BlockActs& a, int64_t N, const float* h, float* out) {
  const float* ye = a.ye.data<float>();
  const float* gw = a.topk_w.data<float>();
  const int32_t* row_of_slot = a.row_of_slot.data<int32_t>();
  parallel_for(N, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * m.d;
      if (h) {
        std::memcpy(o, h + t * m.d, size_t(m.d) * 4);
      } else {
        std::memset(o, 0, size_t(m.d) * 4);
      }
      for (int64_t k = 0; k < m.K; ++k) {
        const int32_t row = row_of_slot[t * m.K + k];
        if (row < 0) continue;  // dropped, or a token nothing reads (BlockContext::keep)
        const float g = gw[t * m.K + k];
        const float* y = ye + int64_t(row) * m.d;
        for (int64_t i = 0; i < m.d; ++i) o[i] += g * y[i];
      }
    }
  });
}

}  // namespace

namespace {

// A dense layer's MLP, out = h + down(silu(gate(xn2)) * up(xn2)); under TP each rank holds
// its Fd/T rows of gate and up and columns of down, and the partial outputs add up.
void dense_forward(const BlockContext& ctx, const Dims& m, const LayerView& w, int64_t N,
                   BlockActs& a, const float* h, float* out) {
  const float* gate_up = w.mlp;                  // [2Fd, d]
  const float* down = gate_up + 2 * m.Fd * m.d;  // [d, Fd]
  a.he = f32({N, 2 * m.Fd});
  a.ae = f32({N, m.Fd});
  linear_forward(ctx.precision, a.xn2.data<float>(), weight(ctx, gate_up, ParamRole::kGate),
                 a.he.data<float>(), N, m.d, 2 * m.Fd);
  kernels::swiglu_forward(a.he.data<float>(), a.ae.data<float>(), N, m.Fd);
  const bool residual = h && adds_residual(ctx);
  if (residual) std::memcpy(out, h, size_t(N * m.d) * 4);
  linear_forward(ctx.precision, a.ae.data<float>(), weight(ctx, down, ParamRole::kDown), out, N,
                 m.Fd, m.d, residual);
  tp_sum(ctx.tp, out, N * m.d);
}

}  // namespace

void moe_forward(const BlockContext& ctx, const LayerView& w, int64_t N, BlockActs& a,
                 const float* h, float* out, kernels::RouterLosses* losses) {
  const Dims m(ctx.config);
  if (!w.router) {
    dense_forward(ctx, m, w, N, a, h, out);
    return;
  }
  route(ctx, m, w, N, a, losses);
  // Replayed routes bring their own drops: the pass that chose them decides, not this one.
  const int64_t capacity = ctx.capacity_factor > 0 && !ctx.replay
                               ? kernels::expert_capacity(ctx.capacity_factor, N, m.K, m.E)
                               : 0;
  const int64_t dropped = dispatch(ctx, m, N, ctx.keep, capacity, a);
  if (losses) {
    losses->slots += N * m.K;
    losses->dropped += dropped;
  }
  if (ctx.experts) {
    // A token takes one slot of an expert at most, so no expert gets more than N rows from
    // this rank: a capacity beyond that would only pad the dispatch.
    send_to_experts(*ctx.experts, m.d, capacity > 0 ? std::min(capacity, N) : 0, a);
    a.ye = from_experts(*ctx.experts, m.d, a, run_experts(ctx, m, w, a));
  } else {
    a.first_run = 0;
    a.run_begin = a.expert_begin;
    a.ye = run_experts(ctx, m, w, a);
  }
  // Under TP each rank's ye is its ffn rows' share of the experts' outputs (down_proj is row
  // parallel); the gate weights are the same on every rank, so the combined shares add up.
  combine(m, a, N, adds_residual(ctx) ? h : nullptr, out);
  tp_sum(ctx.tp, out, N * m.d);
}

namespace {

// Qwen3's per-head RMSNorm of q and k over head_dim, before RoPE; the inputs kept for the
// backward pass.
void qk_norm_forward(const ModelConfig& c, const LayerView& w, int64_t N, BlockActs& a) {
  const Dims m(c);
  a.q_raw = std::move(a.q);
  a.k_raw = std::move(a.k);
  a.q = f32({N, m.qd});
  a.k = f32({N, m.kvd});
  a.rstd_q = f32({N * m.H});
  a.rstd_k = f32({N * m.Hkv});
  kernels::rmsnorm_forward(a.q_raw.data<float>(), w.q_norm, a.q.data<float>(),
                           a.rstd_q.data<float>(), N * m.H, m.Dh, float(c.rms_eps));
  kernels::rmsnorm_forward(a.k_raw.data<float>(), w.k_norm, a.k.data<float>(),
                           a.rstd_k.data<float>(), N * m.Hkv, m.Dh, float(c.rms_eps));
}

}  // namespace

void block_forward(const BlockContext& ctx, const BlockDims& b, const LayerView& w, BlockActs& a,
                   float* out, kernels::RouterLosses* losses) {
  const Dims m(ctx.config);
  const int64_t N = b.tokens;
  const Precision p = ctx.precision;

  // ---- attention ----
  a.xn1 = f32({N, m.d});
  a.rstd1 = f32({N});
  kernels::rmsnorm_forward(a.x.data<float>(), w.attn_norm, a.xn1.data<float>(),
                           a.rstd1.data<float>(), N, m.d, float(ctx.config.rms_eps));
  Tensor qkv = f32({N, m.qkvd});
  linear_forward(p, a.xn1.data<float>(), weight(ctx, w.wqkv, ParamRole::kQ), qkv.data<float>(), N,
                 m.d, m.qkvd);
  a.q = f32({N, m.qd});
  a.k = f32({N, m.kvd});
  a.v = f32({N, m.kvd});
  gather_columns(a.q.data<float>(), qkv.data<float>(), N, m.qkvd, 0, m.qd);
  gather_columns(a.k.data<float>(), qkv.data<float>(), N, m.qkvd, m.qd, m.kvd);
  gather_columns(a.v.data<float>(), qkv.data<float>(), N, m.qkvd, m.qd + m.kvd, m.kvd);
  qkv = Tensor();
  if (w.q_norm) qk_norm_forward(ctx.config, w, N, a);
  kernels::rope_forward(a.q.data<float>(), ctx.rope, b.batch, b.seq, m.H, 0);
  kernels::rope_forward(a.k.data<float>(), ctx.rope, b.batch, b.seq, m.Hkv, 0);
  a.att = f32({N, m.qd});
  a.lse = f32({b.batch, m.H, b.seq});
  kernels::attention_forward(attention_shape(m, b), a.q.data<float>(), a.k.data<float>(),
                             a.v.data<float>(), a.att.data<float>(), a.lse.data<float>());
  // o_proj is row parallel under TP: each rank's heads give a partial sum.
  const bool residual = adds_residual(ctx);
  a.h = residual ? a.x.clone() : f32({N, m.d});
  linear_forward(p, a.att.data<float>(), weight(ctx, w.wo, ParamRole::kO), a.h.data<float>(), N,
                 m.qd, m.d, residual);
  tp_sum(ctx.tp, a.h.data<float>(), N * m.d);

  a.xn2 = f32({N, m.d});
  a.rstd2 = f32({N});
  kernels::rmsnorm_forward(a.h.data<float>(), w.moe_norm, a.xn2.data<float>(),
                           a.rstd2.data<float>(), N, m.d, float(ctx.config.rms_eps));
  moe_forward(ctx, w, N, a, a.h.data<float>(), out, losses);
}

namespace {

// d += src, elementwise over n floats.
void add_into(float* d, const float* src, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) d[i] += src[i];
  });
}

// Combine backward: the gate weights' gradient (dot of dout with each chosen expert's output,
// in double) and each expert row's output gradient (gate weight times dout).
void combine_backward(const Dims& m, const BlockActs& a, const float* dout, int64_t N,
                      float* dtopk_w, Tensor& dye) {
  const float* ye = a.ye.data<float>();
  const float* gw = a.topk_w.data<float>();
  const int32_t* row_of_slot = a.row_of_slot.data<int32_t>();
  float* dw = dtopk_w;
  float* dy = dye.data<float>();
  parallel_for(N, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* go = dout + t * m.d;
      for (int64_t k = 0; k < m.K; ++k) {
        const int64_t row = row_of_slot[t * m.K + k];
        if (row < 0) {  // dropped, or read by nothing: its output is 0, and so is its gate's grad
          dw[t * m.K + k] = 0;
          continue;
        }
        const float* y = ye + row * m.d;
        float* dyr = dy + row * m.d;
        const float gk = gw[t * m.K + k];
        double dot = 0;
        for (int64_t i = 0; i < m.d; ++i) {
          dot += double(go[i]) * y[i];
          dyr[i] = gk * go[i];
        }
        dw[t * m.K + k] = float(dot);
      }
    }
  });
}

// The backward of the experts this rank ran, over their rows (dye [R, d]): weight gradients
// into g (or into `later`), input gradients returned [R, d].
Tensor experts_backward(const BlockContext& ctx, const Dims& m, const LayerView& w,
                        const LayerView& g, const BlockActs& a, const Tensor& dye) {
  const Precision p = ctx.precision;
  WeightGradients* later = ctx.weight_grads;
  const int64_t R = dye.size(0);
  Tensor dae = f32({R, m.F});
  Tensor dhe = f32({R, 2 * m.F});
  Tensor dxe = f32({R, m.d});
  const int64_t runs = int64_t(a.run_begin.size()) - 1;
  WL_CHECK(w.holds_experts(a.first_run, runs) && g.holds_experts(a.first_run, runs))
      << "the backward of experts [" << a.first_run << ", " << a.first_run + runs
      << ") on a rank that holds [" << w.first_expert << ", " << w.first_expert + w.held_experts
      << ")";
  for (size_t i = 0; i + 1 < a.run_begin.size(); ++i) {
    const int64_t r0 = a.run_begin[i], n = a.run_begin[i + 1] - r0;
    if (n == 0) continue;
    const int64_t e = a.first_run + int64_t(i);
    const float* gate_up = w.expert(e);
    const float* down = gate_up + 2 * m.F * m.d;
    float* dgate_up = g.expert(e);
    float* ddown = dgate_up + 2 * m.F * m.d;
    float* da = dae.data<float>() + r0 * m.F;
    float* dh = dhe.data<float>() + r0 * 2 * m.F;
    linear_backward(later, p,
                    {.dy = dye,
                     .dy_row = r0,
                     .x = a.ae,
                     .x_row = r0,
                     .w = weight(ctx, down, ParamRole::kDown, e),
                     .dx = da,
                     .dw = ddown,
                     .n = n,
                     .in = m.F,
                     .out = m.d});
    kernels::swiglu_backward(a.he.data<float>() + r0 * 2 * m.F, da, dh, n, m.F);
    linear_backward(later, p,
                    {.dy = dhe,
                     .dy_row = r0,
                     .x = a.xe,
                     .x_row = r0,
                     .w = weight(ctx, gate_up, ParamRole::kGate, e),
                     .dx = dxe.data<float>() + r0 * m.d,
                     .dw = dgate_up,
                     .n = n,
                     .in = m.d,
                     .out = 2 * m.F});
  }
  return dxe;
}

// Un-dispatch: dxn2[t] = the sum over t's slots of dxe[row], in slot order.
void undispatch(const Dims& m, const BlockActs& a, const Tensor& dxe, int64_t N, float* dxn2) {
  const int32_t* row_of_slot = a.row_of_slot.data<int32_t>();
  const float* src = dxe.data<float>();
  float* dst = dxn2;
  parallel_for(N, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = dst + t * m.d;
      const int32_t* rows = row_of_slot + t * m.K;
      // Slots without a row (dropped, or a token whose experts did not run) add nothing.
      int64_t k = 0;
      while (k < m.K && rows[k] < 0) ++k;
      if (k == m.K) {
        std::memset(o, 0, size_t(m.d) * 4);
        continue;
      }
      std::memcpy(o, src + int64_t(rows[k]) * m.d, size_t(m.d) * 4);
      for (++k; k < m.K; ++k) {
        if (rows[k] < 0) continue;
        const float* r = src + int64_t(rows[k]) * m.d;
        for (int64_t i = 0; i < m.d; ++i) o[i] += r[i];
      }
    }
  });
}

// The router's logits gradient (gates, aux and z losses), then its input gradient added into
// dxn2 and its weight gradient.
void router_backward(const BlockContext& ctx, const Dims& m, const LayerView& w, const LayerView& g,
                     const BlockActs& a, const float* dtopk_w, const BlockGradScales& scales,
                     int64_t N, float* dxn2) {
  Tensor dlogits = f32({N, m.E});
  const kernels::RouterShape rs{.tokens = N,
                                .experts = m.E,
                                .top_k = m.K,
                                .norm_topk = ctx.config.norm_topk,
                                .group_tokens = a.group_tokens};
  kernels::router_backward(rs, {.probs = a.probs.data<float>(),
                                .topk_idx = a.topk_idx.data<int32_t>(),
                                .topk_w = a.topk_w.data<float>(),
                                .lse = a.lse_r.data<float>(),
                                .counts = a.group_counts.data<int64_t>(),
                                .dtopk_w = dtopk_w,
                                .aux_scale = scales.aux,
                                .z_scale = scales.z,
                                .dlogits = dlogits.data<float>()});
  linear_backward(ctx.weight_grads, ctx.precision,
                  {.dy = dlogits,
                   .x = a.xn2,
                   .w = weight(ctx, w.router, ParamRole::kRouter),
                   .dx = dxn2,
                   .dw = g.router,
                   .n = N,
                   .in = m.d,
                   .out = m.E,
                   .accumulate = true});
}

// The q and k norms' backward, in place on dq [N, H*Dh] and dk [N, Hkv*Dh] (after RoPE's).
// Under TP each rank's heads give a partial gradient of the shared norm weights, summed over
// the group; of a kv head's several holders only the leader adds its (identical) share.
void qk_norm_backward(const BlockContext& ctx, const Dims& m, const LayerView& w,
                      const LayerView& g, const BlockActs& a, int64_t N, bool drop_kv, float* dq,
                      float* dk) {
  Tensor dnorms = Tensor::zeros(DType::kF32, {2 * m.Dh});
  float* dqn = ctx.tp ? dnorms.data<float>() : g.q_norm;
  float* dkn = ctx.tp ? dnorms.data<float>() + m.Dh : g.k_norm;
  Tensor dq_raw = f32({N, m.qd}), dk_raw = f32({N, m.kvd});
  kernels::rmsnorm_backward(dq, a.q_raw.data<float>(), w.q_norm, a.rstd_q.data<float>(),
                            dq_raw.data<float>(), dqn, N * m.H, m.Dh);
  kernels::rmsnorm_backward(dk, a.k_raw.data<float>(), w.k_norm, a.rstd_k.data<float>(),
                            dk_raw.data<float>(), dkn, N * m.Hkv, m.Dh);
  std::memcpy(dq, dq_raw.data<float>(), size_t(N * m.qd) * 4);
  std::memcpy(dk, dk_raw.data<float>(), size_t(N * m.kvd) * 4);
  if (!ctx.tp) return;
  if (drop_kv) std::memset(dkn, 0, size_t(m.Dh) * 4);
  tp_sum(ctx.tp, dnorms.data<float>(), 2 * m.Dh);
  add_into(g.q_norm, dnorms.data<float>(), m.Dh);
  add_into(g.k_norm, dnorms.data<float>() + m.Dh, m.Dh);
}

// Attention backward from dh (the gradient after the attention residual) to dxn1, the
// gradient of the normed input: o_proj, attention, RoPE, then the fused qkv projection.
void attention_backward(const BlockContext& ctx, const BlockDims& b, const Dims& m,
                        const LayerView& w, const LayerView& g, const BlockActs& a,
                        const Tensor& dh, Tensor& dxn1) {
  const Precision p = ctx.precision;
  const int64_t N = b.tokens;
  Tensor datt = f32({N, m.qd});
  linear_backward(ctx.weight_grads, p,
                  {.dy = dh,
                   .x = a.att,
                   .w = weight(ctx, w.wo, ParamRole::kO),
                   .dx = datt.data<float>(),
                   .dw = g.wo,
                   .n = N,
                   .in = m.qd,
                   .out = m.d});
  Tensor dq = f32({N, m.qd}), dkv = f32({2, N, m.kvd});
  float* dk = dkv.data<float>();
  float* dv = dk + N * m.kvd;
  kernels::attention_backward(attention_shape(m, b), a.q.data<float>(), a.k.data<float>(),
                              a.v.data<float>(), a.att.data<float>(), a.lse.data<float>(),
                              datt.data<float>(), dq.data<float>(), dk, dv);
  datt = Tensor();
  kernels::rope_backward(dq.data<float>(), ctx.rope, b.batch, b.seq, m.H, 0);
  kernels::rope_backward(dk, ctx.rope, b.batch, b.seq, m.Hkv, 0);
  // A kv head held by several TP ranks served the query heads of all of them: its gradients
  // are the sum over its holders.
  const bool shared_kv = ctx.tp && ctx.tp->kv_copies() > 1;
  if (shared_kv && !ctx.tp->allreduce_kv(dk, 2 * N * m.kvd).ok()) {
    std::memset(dk, 0, size_t(2 * N * m.kvd) * 4);
  }
  const bool drop_kv = shared_kv && !ctx.tp->kv_leader();
  if (w.q_norm) qk_norm_backward(ctx, m, w, g, a, N, drop_kv, dq.data<float>(), dk);
  Tensor dqkv = f32({N, m.qkvd});
  scatter_columns(dqkv.data<float>(), dq.data<float>(), N, m.qkvd, 0, m.qd);
  scatter_columns(dqkv.data<float>(), dk, N, m.qkvd, m.qd, m.kvd);
  scatter_columns(dqkv.data<float>(), dv, N, m.qkvd, m.qd + m.kvd, m.kvd);
  dq = dkv = Tensor();
  const Weight wqkv = weight(ctx, w.wqkv, ParamRole::kQ);
  if (!drop_kv) {
    linear_backward(ctx.weight_grads, p,
                    {.dy = dqkv,
                     .x = a.xn1,
                     .w = wqkv,
                     .dx = dxn1.data<float>(),
                     .dw = g.wqkv,
                     .n = N,
                     .in = m.d,
                     .out = m.qkvd});
  } else {
    // The input gradient is a partial sum over the TP group (q, k and v are column parallel);
    // of a shared kv head's holders only one adds its share, or the sum would count it once
    // per holder. The weight gradient reads every column: a deferred one keeps its own copy.
    linear_weight_gradient(ctx.weight_grads, p, ctx.weight_grads ? dqkv.clone() : dqkv, 0, a.xn1, 0,
                           g.wqkv, N, m.d, m.qkvd);
    parallel_for(N, 256, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        std::memset(dqkv.data<float>() + i * m.qkvd + m.qd, 0, size_t(2 * m.kvd) * 4);
      }
    });
    linear_backward_input(p, dqkv.data<float>(), wqkv, dxn1.data<float>(), N, m.d, m.qkvd);
  }
  tp_sum(ctx.tp, dxn1.data<float>(), N * m.d);
}

// The MoE half, from dout back to the gradient of its normed input, returned at the start of
// a buffer that also holds the gate weights' gradient dtopk_w [N, K]: under TP both are
// partial sums (each rank's experts saw only its ffn rows), and one sum completes them.
Tensor moe_backward(const BlockContext& ctx, const Dims& m, const LayerView& w, const LayerView& g,
                    const BlockActs& a, const float* dout, int64_t N,
                    const BlockGradScales& scales) {
  const int64_t S = a.expert_begin.back();  // the dispatched rows
  Tensor moe_grads = f32({N * (m.d + m.K)});
  float* dxn2 = moe_grads.data<float>();
  float* dtopk_w = dxn2 + N * m.d;
  Tensor dye = f32({S, m.d});
  combine_backward(m, a, dout, N, dtopk_w, dye);
  {
    if (ctx.experts) dye = to_experts(*ctx.experts, m.d, a, dye);
    Tensor dxe = experts_backward(ctx, m, w, g, a, dye);
    dye = Tensor();
    if (ctx.experts) dxe = from_experts(*ctx.experts, m.d, a, dxe);
    undispatch(m, a, dxe, N, dxn2);
  }
  tp_sum(ctx.tp, moe_grads.data<float>(), N * (m.d + m.K));
  router_backward(ctx, m, w, g, a, dtopk_w, scales, N, dxn2);
  return moe_grads;
}

// A dense layer's MLP backward: weight gradients into g (or ctx.weight_grads), the gradient
// of its normed input returned [N, d] (summed over the TP group).
Tensor dense_backward(const BlockContext& ctx, const Dims& m, const LayerView& w,
                      const LayerView& g, const BlockActs& a, const float* dout, int64_t N) {
  const Precision p = ctx.precision;
  const float* gate_up = w.mlp;
  const float* down = gate_up + 2 * m.Fd * m.d;
  float* dgate_up = g.mlp;
  float* ddown = dgate_up + 2 * m.Fd * m.d;
  // A deferred weight gradient reads dout later: it keeps its own copy.
  Tensor dy = Tensor::borrow(const_cast<float*>(dout), DType::kF32, {N, m.d});
  if (ctx.weight_grads) dy = dy.clone();
  Tensor dae = f32({N, m.Fd}), dhe = f32({N, 2 * m.Fd}), dxn2 = f32({N, m.d});
  linear_backward(ctx.weight_grads, p,
                  {.dy = dy,
                   .x = a.ae,
                   .w = weight(ctx, down, ParamRole::kDown),
                   .dx = dae.data<float>(),
                   .dw = ddown,
                   .n = N,
                   .in = m.Fd,
                   .out = m.d});
  kernels::swiglu_backward(a.he.data<float>(), dae.data<float>(), dhe.data<float>(), N, m.Fd);
  linear_backward(ctx.weight_grads, p,
                  {.dy = dhe,
                   .x = a.xn2,
                   .w = weight(ctx, gate_up, ParamRole::kGate),
                   .dx = dxn2.data<float>(),
                   .dw = dgate_up,
                   .n = N,
                   .in = m.d,
                   .out = 2 * m.Fd});
  tp_sum(ctx.tp, dxn2.data<float>(), N * m.d);
  return dxn2;
}

}  // namespace

void block_backward(const BlockContext& ctx, const BlockDims& b, const LayerView& w,
                    const LayerView& g, const BlockActs& a, const float* dout, float* dx,
                    const BlockGradScales& scales) {
  const Dims m(ctx.config);
  const int64_t N = b.tokens;
  Tensor mlp_grads = w.router ? moe_backward(ctx, m, w, g, a, dout, N, scales)
                              : dense_backward(ctx, m, w, g, a, dout, N);
  // moe_norm backward, residual: dh = dout + d(norm).
  Tensor dh = f32({N, m.d});
  kernels::rmsnorm_backward(mlp_grads.data<float>(), a.h.data<float>(), w.moe_norm,
                            a.rstd2.data<float>(), dh.data<float>(), g.moe_norm, N, m.d);
  add_into(dh.data<float>(), dout, N * m.d);
  mlp_grads = Tensor();
  // Attention half; attn_norm backward, residual: dx = dh + d(norm).
  Tensor dxn1 = f32({N, m.d});
  attention_backward(ctx, b, m, w, g, a, dh, dxn1);
  kernels::rmsnorm_backward(dxn1.data<float>(), a.x.data<float>(), w.attn_norm,
                            a.rstd1.data<float>(), dx, g.attn_norm, N, m.d);
  add_into(dx, dh.data<float>(), N * m.d);
}

}  // namespace wl::model::detail
