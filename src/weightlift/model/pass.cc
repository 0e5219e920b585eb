// StagePass (pass.h): the units' forward and backward, one at a time, with the hooks around
// each. The kernels and their order are those of DESIGN.md's model; detail/block.cc holds a
// block's insides.
#include "weightlift/model/pass.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/core/memory_budget.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/kernels/embedding.h"
#include "weightlift/kernels/rmsnorm.h"
#include "weightlift/model/detail/block.h"
#include "weightlift/model/detail/linear.h"

namespace wl::model {
using detail::f32;

namespace {

// The aux and z losses are the mean over the layers that route (1 when none does).
double router_layers(const ModelConfig& c) { return double(std::max<int64_t>(1, c.moe_layers())); }

}  // namespace

uint64_t activation_bytes(const ModelConfig& c, Stage stage, int64_t batch, int64_t seq,
                          bool checkpointing) {
  // Saturating: model-info plans layouts far beyond this machine. Tensor::empty rounds up to
  // 64 bytes, and takes 64 for an empty tensor.
  const auto tensor = [](std::initializer_list<uint64_t> dims, uint64_t bytes_each) {
    uint64_t n = bytes_each;
    for (uint64_t d : dims) n = mul_sat(n, d);
    return std::max<uint64_t>(mul_sat(n / 64 + (n % 64 != 0), 64), 64);
  };
  const uint64_t N = mul_sat(uint64_t(batch), uint64_t(seq)), d = uint64_t(c.hidden_size);
  const uint64_t E = uint64_t(c.num_experts), S = mul_sat(N, uint64_t(c.top_k));
  // detail::BlockActs, field by field: x and group_counts survive gradient checkpointing.
  std::vector<uint64_t> block = {tensor({N, d}, 4), tensor({E}, 8)};
  // The largest of a dense layer's and an MoE layer's: a stage's blocks are counted alike.
  if (!checkpointing) {
    const uint64_t qd = uint64_t(c.q_dim()), kvd = uint64_t(c.kv_dim());
    const uint64_t F = std::max(uint64_t(c.ffn_dim), uint64_t(c.dense_ffn_dim));
    const uint64_t R = std::max(S, N);  // an MoE's dispatched rows; a dense MLP's tokens
    const uint64_t K = uint64_t(c.top_k), H = uint64_t(c.num_heads);
    block.insert(block.end(), {
                                  tensor({N, d}, 4),      // xn1
                                  tensor({N}, 4),         // rstd1
                                  tensor({N, qd}, 4),     // q
                                  tensor({N, kvd}, 4),    // k
                                  tensor({N, kvd}, 4),    // v
                                  tensor({N, qd}, 4),     // att
                                  tensor({N, H}, 4),      // lse
                                  tensor({N, d}, 4),      // h
                                  tensor({N, d}, 4),      // xn2
                                  tensor({N}, 4),         // rstd2
                                  tensor({N, E}, 4),      // probs
                                  tensor({N, K}, 4),      // topk_w
                                  tensor({N}, 4),         // lse_r
                                  tensor({N, K}, 4),      // topk_idx
                                  tensor({E}, 8),         // counts
                                  tensor({S}, 4),         // row_of_slot
                                  tensor({S}, 4),         // token_of_row
                                  tensor({S, d}, 4),      // xe
                                  tensor({R, 2 * F}, 4),  // he
                                  tensor({R, F}, 4),      // ae
                                  tensor({S, d}, 4),      // ye
                              });
    if (c.qk_norm) {
      block.insert(block.end(), {tensor({N, qd}, 4), tensor({N, kvd}, 4),  // q_raw, k_raw
                                 tensor({N, H}, 4),                        // rstd_q
                                 tensor({N, uint64_t(c.num_kv_heads)}, 4)});
    }
  }
  uint64_t per_block = 0;
  for (uint64_t b : block) per_block = add_sat(per_block, b);
  const int64_t head = c.num_layers + 1;
  const int64_t layers = std::min<int64_t>(stage.last, head - 1) - std::max(stage.first, 1) + 1;
  // The blocks, and the stage's output (with the head: the final norm's input).
  uint64_t bytes =
      add_sat(mul_sat(uint64_t(std::max<int64_t>(layers, 0)), per_block), tensor({N, d}, 4));
  if (stage.last == head) {  // the final norm's output and 1/rms, the logits
    bytes = add_sat(bytes, tensor({N, d}, 4));
    bytes = add_sat(bytes, tensor({N}, 4));
    bytes = add_sat(bytes, tensor({N, uint64_t(c.vocab_size)}, 4));
  }
  return bytes;
}

StagePass::StagePass(const PassModel& model, Stage stage, const int64_t* tokens, int64_t batch,
                     int64_t seq, const StepOptions& options, PassHooks* hooks)
    : model_(model),
      stage_(stage),
      tokens_(tokens),
      batch_(batch),
      seq_(seq),
      tokens_n_(batch * seq),
      options_(options),
      hooks_(hooks ? hooks : &default_hooks_) {
  const ModelConfig& c = model.config;
  WL_CHECK(seq >= 1 && seq <= c.max_seq_len) << "seq " << seq << " max " << c.max_seq_len;
  WL_CHECK(0 <= stage.first && stage.first <= stage.last && stage.last < model.units.count())
      << "stage [" << stage.first << ", " << stage.last << "] of " << model.units.count()
      << " units";
  WL_CHECK(stage.first > 0 || tokens != nullptr) << "the embedding's stage needs the tokens";
  acts_.resize(size_t(c.num_layers));
  if (options.targets && !options.logits_out && has_head()) {
    for (int64_t r = 0; r < tokens_n_; ++r) {
      if (options.targets[r] != kernels::kIgnoreIndex) head_rows_.push_back(r);
    }
    if (int64_t(head_rows_.size()) < tokens_n_) {
      keep_.assign(size_t(tokens_n_), 0);
      for (int64_t r : head_rows_) keep_[size_t(r)] = 1;
    } else {
      head_rows_.clear();
    }
  }
}

namespace {

// dst[i] = src[rows[i]], rows of `width` floats.
void gather_rows(float* dst, const float* src, std::span<const int64_t> rows, int64_t width) {
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(dst + int64_t(i) * width, src + rows[i] * width, size_t(width) * 4);
  }
}

// dst[rows[i]] = src[i]: gather_rows' inverse.
void scatter_rows(float* dst, const float* src, std::span<const int64_t> rows, int64_t width) {
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(dst + rows[i] * width, src + int64_t(i) * width, size_t(width) * 4);
  }
}

}  // namespace

StagePass::~StagePass() = default;

Status StagePass::forward(const float* x_in, bool for_backward) {
  const int64_t d = model_.config.hidden_size;
  if (stage_.first > 0) {
    WL_CHECK(x_in != nullptr) << "stage from unit " << stage_.first << " needs its input";
    x_ = f32({tokens_n_, d});
    std::memcpy(x_.raw(), x_in, x_.nbytes());
  }
  for (int u = stage_.first; u <= stage_.last; ++u) {
    WL_RETURN_IF_ERROR(hooks_->before_unit(u, Direction::kForward, model_.weights, model_.grads));
    forward_unit(u, for_backward);
    WL_RETURN_IF_ERROR(hooks_->after_unit(u, Direction::kForward, model_.weights, model_.grads));
  }
  forward_done_ = true;
  return ok_status();
}

detail::BlockContext StagePass::block_context(int layer) const {
  const ModelConfig& c = model_.config;
  detail::BlockContext ctx{c, model_.rope, options_.precision};
  ctx.layer = layer;
  ctx.weight_copies = model_.weight_copies;
  const int64_t at = int64_t(layer) * c.top_k;  // layer's first entry of token 0
  ctx.route_stride = c.num_layers * c.top_k;
  if (options_.replay_routes) ctx.replay = options_.replay_routes + at;
  if (options_.routes_out) ctx.routes_out = options_.routes_out + at;
  ctx.replay_differ = options_.replay_differ;
  ctx.experts = hooks_->expert_exchange();
  ctx.tp = hooks_->tensor_parallel();
  ctx.capacity_factor = c.capacity_factor.value_or(0.0);
  if (head_subset() && layer == c.num_layers - 1) ctx.keep = keep_.data();
  return ctx;
}

detail::Weight StagePass::head_weight(const ModelView& w) const {
  return {w.head, model_.weight_copies, {.role = ParamRole::kHead}};
}

void StagePass::forward_unit(int unit, bool for_backward) {
  const ModelConfig& c = model_.config;
  const int64_t N = tokens_n_, d = c.hidden_size, V = c.vocab_size;
  const ModelView& w = model_.weights;
  if (unit == 0) {
    x_ = f32({N, d});
    kernels::embedding_forward(w.embed, tokens_, x_.data<float>(), N, V, d);
    return;
  }
  if (unit == model_.units.head()) {
    int64_t rows = N;
    if (head_subset()) {  // x_ becomes the rows with a target
      rows = int64_t(head_rows_.size());
      Tensor kept = f32({rows, d});
      gather_rows(kept.data<float>(), x_.data<float>(), head_rows_, d);
      x_ = std::move(kept);
    }
    xf_ = f32({rows, d});
    rstd_ = f32({rows});
    kernels::rmsnorm_forward(x_.data<float>(), w.norm, xf_.data<float>(), rstd_.data<float>(), rows,
                             d, float(c.rms_eps));
    logits_ = f32({rows, V});
    if (rows > 0) {
      detail::linear_forward(options_.precision, xf_.data<float>(), head_weight(w),
                             logits_.data<float>(), rows, d, V);
    }
    if (options_.logits_out) std::memcpy(options_.logits_out, logits_.raw(), logits_.nbytes());
    if (!for_backward) x_ = xf_ = rstd_ = Tensor();
    return;
  }
  const int layer = unit - 1;
  detail::BlockActs& a = acts_[size_t(layer)];
  a.x = x_;
  x_ = f32({N, d});
  detail::BlockContext ctx = block_context(layer);
  ctx.sum_router_counts = [&](int64_t* counts, int64_t tokens) {
    return hooks_->sum_router_counts(layer, counts, c.num_experts, tokens);
  };
  detail::block_forward(ctx, {batch_, seq_, N}, w.layers[size_t(layer)], a, x_.data<float>(),
                        &router_);
  if (!for_backward) {
    a = detail::BlockActs();
  } else if (options_.checkpointing) {
    a.keep_only_input();
  }
}

const int64_t* StagePass::targets_of_head_rows(const int64_t* targets,
                                               std::vector<int64_t>& kept) const {
  WL_CHECK(!options_.targets || options_.logits_out || targets == options_.targets)
      << "a loss over other targets than StepOptions::targets, which chose the head's rows";
  if (!head_subset()) return targets;
  kept.resize(head_rows_.size());
  for (size_t i = 0; i < head_rows_.size(); ++i) kept[i] = targets[head_rows_[i]];
  return kept.data();
}

LossTerms StagePass::router_terms() const {
  const ModelConfig& c = model_.config;
  LossTerms out;
  out.aux = c.aux_loss_alpha * router_.aux / router_layers(c);
  out.z = c.z_loss_beta * router_.z / router_layers(c);
  out.slots = router_.slots;
  out.dropped = router_.dropped;
  return out;
}

LossTerms StagePass::loss(const int64_t* targets) {
  WL_CHECK(has_head()) << "loss() on a stage without the head";
  WL_CHECK(!loss_done_) << "loss() twice";
  WL_CHECK(forward_done_) << "loss() before a forward pass that finished";
  loss_done_ = true;
  const ModelConfig& c = model_.config;
  const int64_t N = tokens_n_;
  LossTerms out = router_terms();
  out.count = kernels::count_targets(targets, N);
  const bool gradient = xf_.raw() != nullptr;  // forward kept what backward needs
  const int64_t denom = options_.ce_denominator > 0 ? options_.ce_denominator : out.count;
  const float ce_scale = denom > 0 ? options_.grad_scale / float(denom) : 0.0f;
  float* logits = logits_.data<float>();
  std::vector<int64_t> kept;
  const int64_t* head_targets = targets_of_head_rows(targets, kept);
  // d loss / d logits overwrites the logits.
  const kernels::CrossEntropyResult ce =
      kernels::cross_entropy(logits, head_targets, logits_.size(0), c.vocab_size,
                             gradient ? logits : nullptr, gradient ? ce_scale : 1.0f);
  out.ce = ce.count > 0 ? ce.loss_sum / double(ce.count) : 0.0;
  return out;
}

LossTerms StagePass::token_loss(const int64_t* targets, const TokenLossFn& fn) {
  WL_CHECK(has_head()) << "token_loss() on a stage without the head";
  WL_CHECK(!loss_done_) << "a loss twice";
  WL_CHECK(forward_done_) << "token_loss() before a forward pass that finished";
  loss_done_ = true;
  const bool gradient = xf_.raw() != nullptr;  // forward kept what backward needs
  const ModelConfig& c = model_.config;
  const int64_t N = tokens_n_, V = c.vocab_size;
  LossTerms out = router_terms();
  out.count = kernels::count_targets(targets, N);
  float* logits = logits_.data<float>();
  std::vector<int64_t> kept;
  const int64_t* head_targets = targets_of_head_rows(targets, kept);
  const int64_t rows = logits_.size(0);  // N, or the rows with a target
  const auto position = [&](int64_t i) { return head_subset() ? head_rows_[size_t(i)] : i; };
  std::vector<double> nll(static_cast<size_t>(rows));
  kernels::cross_entropy_rows(logits, head_targets, rows, V, nullptr, nullptr, nll.data());
  std::vector<double> logp(static_cast<size_t>(N), 0.0);
  for (int64_t i = 0; i < rows; ++i) logp[size_t(position(i))] = -nll[size_t(i)];
  std::vector<float> coef(static_cast<size_t>(N), 0.0f);
  out.ce = fn(logp, coef);
  if (!gradient || rows == 0) return out;
  // The head's rows' coefficients; f16's loss scale multiplies every gradient.
  std::vector<float> head_coef(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    head_coef[size_t(i)] = coef[size_t(position(i))] * options_.grad_scale;
  }
  // d loss / d logits overwrites the logits.
  kernels::cross_entropy_rows(logits, head_targets, rows, V, head_coef.data(), logits, nll.data());
  return out;
}

Status StagePass::backward(const float* dout) { return run_backward(dout, false); }

Status StagePass::backward_inputs(const float* dout) { return run_backward(dout, true); }

Status StagePass::run_backward(const float* dout, bool defer_weights) {
  const int64_t d = model_.config.hidden_size;
  WL_CHECK(!weights_pending_) << "a backward pass while the last one's weight gradients wait";
  if (has_head()) {
    WL_CHECK(loss_done_) << "backward() of the head's stage before loss()";
  } else {
    WL_CHECK(dout != nullptr) << "stage ending at unit " << stage_.last << " needs its gradient";
    dx_ = f32({tokens_n_, d});
    std::memcpy(dx_.raw(), dout, dx_.nbytes());
  }
  if (defer_weights) later_.resize(size_t(model_.units.count()));
  for (int u = stage_.last; u >= stage_.first; --u) {
    WL_RETURN_IF_ERROR(hooks_->before_unit(u, Direction::kBackward, model_.weights, model_.grads));
    backward_unit(u, defer_weights ? &later_[size_t(u)] : nullptr);
    if (!defer_weights) {
      WL_RETURN_IF_ERROR(hooks_->after_unit(u, Direction::kBackward, model_.weights, model_.grads));
    }
  }
  if (stage_.first == 0) dx_ = Tensor();
  weights_pending_ = defer_weights;
  return ok_status();
}

Status StagePass::backward_weights() {
  WL_CHECK(weights_pending_) << "backward_weights() without backward_inputs() before it";
  weights_pending_ = false;
  for (int u = stage_.last; u >= stage_.first; --u) {
    later_[size_t(u)].run();
    WL_RETURN_IF_ERROR(hooks_->after_unit(u, Direction::kBackward, model_.weights, model_.grads));
  }
  later_.clear();
  return ok_status();
}

void StagePass::backward_unit(int unit, detail::WeightGradients* later) {
  const ModelConfig& c = model_.config;
  const int64_t N = tokens_n_, d = c.hidden_size, V = c.vocab_size;
  const ModelView& w = model_.weights;
  const ModelView& g = model_.grads;
  const Precision p = options_.precision;
  if (unit == model_.units.head()) {
    const int64_t rows = logits_.size(0);  // N, or the rows with a target
    Tensor dxf = f32({rows, d});
    Tensor dx = f32({rows, d});
    if (rows > 0) {
      detail::linear_backward(later, p,
                              {.dy = logits_,
                               .x = xf_,
                               .w = head_weight(w),
                               .dx = dxf.data<float>(),
                               .dw = g.head,
                               .n = rows,
                               .in = d,
                               .out = V});
      kernels::rmsnorm_backward(dxf.data<float>(), x_.data<float>(), w.norm, rstd_.data<float>(),
                                dx.data<float>(), g.norm, rows, d);
    }
    logits_ = Tensor();
    if (head_subset()) {  // the other positions reach no loss: their gradient is 0
      dx_ = Tensor::zeros(DType::kF32, {N, d});
      scatter_rows(dx_.data<float>(), dx.data<float>(), head_rows_, d);
    } else {
      dx_ = std::move(dx);
    }
    x_ = xf_ = rstd_ = Tensor();
    return;
  }
  if (unit == 0) {
    kernels::embedding_backward(dx_.data<float>(), tokens_, g.embed, N, V, d);
    return;
  }
  const int layer = unit - 1;
  detail::BlockActs& a = acts_[size_t(layer)];
  detail::BlockContext ctx = block_context(layer);
  ctx.weight_grads = later;
  const detail::BlockDims dims{batch_, seq_, N};
  if (!a.complete()) {  // gradient checkpointing: rerun the block's forward from its input
    ctx.recompute = true;
    Tensor scratch = f32({N, d});
    detail::block_forward(ctx, dims, w.layers[size_t(layer)], a, scratch.data<float>(), nullptr);
  }
  const detail::BlockGradScales scales{
      .aux = float(c.aux_loss_alpha / router_layers(c)) * options_.aux_weight * options_.grad_scale,
      .z = float(c.z_loss_beta / router_layers(c)) * options_.aux_weight * options_.grad_scale};
  detail::block_backward(ctx, dims, w.layers[size_t(layer)], g.layers[size_t(layer)], a,
                         dx_.data<float>(), dx_.data<float>(), scales);
  a = detail::BlockActs();
}

}  // namespace wl::model
