// Orchestration of the model: embedding, the blocks, the final norm and head, the losses,
// and the backward pass in reverse, with or without gradient checkpointing.
#include "weightlift/model/transformer.h"

#include <cmath>
#include <cstring>
#include <set>

#include "weightlift/core/parallel.h"
#include "weightlift/core/random.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/kernels/embedding.h"
#include "weightlift/kernels/rmsnorm.h"
#include "weightlift/model/detail/block.h"
#include "weightlift/model/detail/linear.h"

namespace wl::model {

Transformer::Transformer(const ModelConfig& config)
    : config_(config),
      layout_(config),
      params_(Tensor::zeros(DType::kF32, {layout_.total()})),
      grads_(Tensor::zeros(DType::kF32, {layout_.total()})),
      rope_(kernels::make_rope_table(config.max_seq_len, config.head_dim, config.rope_theta,
                                     config.rope_ntk_alpha)) {
  WL_CHECK(config.validate().ok()) << config.validate().to_string();
}

Transformer::~Transformer() = default;

namespace {
// FNV-1a: a name hash that, unlike std::hash, is the same on every standard library, so a
// seed gives the same weights everywhere.
uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
}  // namespace

void Transformer::init(uint64_t seed) {
  const float residual_scale = 1.0f / std::sqrt(2.0f * float(config_.num_layers));
  float* base = params_.data<float>();
  for (const ParamInfo& p : layout_.params()) {
    float* w = base + p.offset;
    if (p.shape.size() == 1) {
      for (int64_t i = 0; i < p.numel(); ++i) w[i] = 1.0f;
      continue;
    }
    // One stream per parameter, so a parameter's values do not depend on the others' sizes.
    Rng rng(seed ^ fnv1a(p.name));
    const bool residual = p.name.ends_with("o_proj.weight") || p.name.ends_with("down_proj.weight");
    const float std_dev = 0.02f * (residual ? residual_scale : 1.0f);
    for (int64_t i = 0; i < p.numel(); ++i) w[i] = std_dev * rng.normal();
  }
}

void Transformer::zero_grads() { grads_.fill_zero(); }

Status Transformer::load(const SafetensorsFile& file) {
  const SafetensorsFile* files[] = {&file};
  return read_params(layout_, files, params_.data<float>());
}

Status Transformer::load(const std::string& path) {
  WL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(path));
  return load(f);
}

Status Transformer::save(const std::string& path) const {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ParamInfo& p : layout_.params()) {
    tensors.emplace_back(p.name,
                         Tensor::borrow(params_.data<float>() + p.offset, DType::kF32, p.shape));
  }
  return write_safetensors(path, tensors, {{"format", "pt"}});
}

namespace {

int64_t count_targets(const int64_t* targets, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += targets[i] != kernels::kIgnoreIndex;
  return c;
}

// The forward pass to the logits, shared by training and evaluation.
struct ForwardPass {
  std::vector<detail::BlockActs> acts;  // per block; only inputs under checkpointing
  Tensor x, xf, rstd;                   // last block output, final norm output, its 1/rms
  Tensor logits;                        // [N, V]
  kernels::RouterLosses router;         // summed over layers, unweighted
};

// What the forward pass keeps of each block for a backward pass.
enum class KeepActs {
  kNone,         // evaluation: no backward follows
  kAll,          // every activation the block's backward reads
  kBlockInputs,  // gradient checkpointing: the block's input, its forward is rerun
};

ForwardPass run_forward(Transformer& m, const int64_t* tokens, int64_t batch, int64_t seq,
                        Precision precision, KeepActs keep) {
  const ModelConfig& c = m.config();
  WL_CHECK(seq >= 1 && seq <= c.max_seq_len) << "seq " << seq << " max " << c.max_seq_len;
  const int64_t N = batch * seq, d = c.hidden_size, V = c.vocab_size, L = c.num_layers;
  const detail::BlockDims dims{batch, seq, N};
  const detail::BlockContext ctx{c, m.rope(), precision};
  ModelView w = m.param_view();
  ForwardPass f;
  f.acts.resize(size_t(L));
  Tensor x = Tensor::empty(DType::kF32, {N, d});
  kernels::embedding_forward(w.embed, tokens, x.data<float>(), N, V, d);
  for (int64_t l = 0; l < L; ++l) {
    detail::BlockActs& a = f.acts[size_t(l)];
    a.x = x;
    x = Tensor::empty(DType::kF32, {N, d});
    detail::block_forward(ctx, dims, w.layers[size_t(l)], a, x.data<float>(), &f.router);
    if (keep == KeepActs::kNone) a = detail::BlockActs();
    if (keep == KeepActs::kBlockInputs) a.keep_only_input();
  }
  f.x = x;
  f.xf = Tensor::empty(DType::kF32, {N, d});
  f.rstd = Tensor::empty(DType::kF32, {N});
  kernels::rmsnorm_forward(x.data<float>(), w.norm, f.xf.data<float>(), f.rstd.data<float>(), N, d,
                           float(c.rms_eps));
  f.logits = Tensor::empty(DType::kF32, {N, V});
  detail::linear_forward(precision, f.xf.data<float>(), w.head, f.logits.data<float>(), N, d, V);
  return f;
}

LossTerms router_terms(const ModelConfig& c, const kernels::RouterLosses& r) {
  LossTerms t;
  t.aux = c.aux_loss_alpha * r.aux / double(c.num_layers);
  t.z = c.z_loss_beta * r.z / double(c.num_layers);
  return t;
}

}  // namespace

LossTerms Transformer::forward_backward(const int64_t* tokens, const int64_t* targets,
                                        int64_t batch, int64_t seq, const StepOptions& opts) {
  const ModelConfig& c = config_;
  const int64_t N = batch * seq, d = c.hidden_size, V = c.vocab_size, L = c.num_layers;
  const detail::BlockDims dims{batch, seq, N};
  const detail::BlockContext ctx{c, rope_, opts.precision};
  ForwardPass f = run_forward(*this, tokens, batch, seq, opts.precision,
                              opts.checkpointing ? KeepActs::kBlockInputs : KeepActs::kAll);
  if (opts.logits_out) std::memcpy(opts.logits_out, f.logits.data<float>(), f.logits.nbytes());
  ModelView w = param_view(), g = grad_view();

  // ---- losses; dlogits overwrites logits ----
  LossTerms out = router_terms(c, f.router);
  out.count = count_targets(targets, N);
  const int64_t denom = opts.ce_denominator > 0 ? opts.ce_denominator : out.count;
  const float ce_scale = denom > 0 ? opts.grad_scale / float(denom) : 0.0f;
  float* dlogits = f.logits.data<float>();
  kernels::CrossEntropyResult ce =
      kernels::cross_entropy(dlogits, targets, N, V, dlogits, ce_scale);
  out.ce = ce.count > 0 ? ce.loss_sum / double(ce.count) : 0.0;

  // ---- backward: head, final norm ----
  detail::linear_backward_weight(opts.precision, dlogits, f.xf.data<float>(), g.head, N, d, V);
  Tensor dxf = Tensor::empty(DType::kF32, {N, d});
  detail::linear_backward_input(opts.precision, dlogits, w.head, dxf.data<float>(), N, d, V);
  f.logits = Tensor();
  Tensor dx = Tensor::empty(DType::kF32, {N, d});
  kernels::rmsnorm_backward(dxf.data<float>(), f.x.data<float>(), w.norm, f.rstd.data<float>(),
                            dx.data<float>(), g.norm, N, d);
  dxf = f.xf = f.x = Tensor();

  // ---- blocks in reverse; recompute a block's insides first under checkpointing ----
  const detail::BlockGradScales scales{
      .aux = float(c.aux_loss_alpha / double(L)) * opts.aux_weight * opts.grad_scale,
      .z = float(c.z_loss_beta / double(L)) * opts.aux_weight * opts.grad_scale};
  for (int64_t l = L - 1; l >= 0; --l) {
    detail::BlockActs& a = f.acts[size_t(l)];
    if (!a.complete()) {
      Tensor scratch = Tensor::empty(DType::kF32, {N, d});
      detail::block_forward(ctx, dims, w.layers[size_t(l)], a, scratch.data<float>(), nullptr);
    }
    detail::block_backward(ctx, dims, w.layers[size_t(l)], g.layers[size_t(l)], a, dx.data<float>(),
                           dx.data<float>(), scales);
    a = detail::BlockActs();
  }
  kernels::embedding_backward(dx.data<float>(), tokens, g.embed, N, V, d);
  return out;
}

LossTerms Transformer::evaluate(const int64_t* tokens, const int64_t* targets, int64_t batch,
                                int64_t seq, const StepOptions& opts) {
  ForwardPass f = run_forward(*this, tokens, batch, seq, opts.precision, KeepActs::kNone);
  if (opts.logits_out) std::memcpy(opts.logits_out, f.logits.data<float>(), f.logits.nbytes());
  kernels::CrossEntropyResult ce = kernels::cross_entropy(
      f.logits.data<float>(), targets, batch * seq, config_.vocab_size, nullptr, 1.0f);
  LossTerms out = router_terms(config_, f.router);
  out.count = ce.count;
  out.ce = ce.count > 0 ? ce.loss_sum / double(ce.count) : 0.0;
  return out;
}

}  // namespace wl::model
