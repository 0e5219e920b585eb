// The inference worker of worker.h: a KV-cached forward pass over one TP rank's shard of the
// inference layout, two allreduces per block, and the decoding loop around it.
#include "weightlift/infer/worker.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/timing.h"
#include "weightlift/infer/dequant_linear.h"
#include "weightlift/kernels/attention.h"
#include "weightlift/kernels/rmsnorm.h"
#include "weightlift/kernels/router.h"
#include "weightlift/kernels/swiglu.h"
#include "weightlift/model/generate.h"

namespace wl::infer {

using Clock = std::chrono::steady_clock;

// This rank's keys and values (after RoPE) for every layer and row:
// [layers][rows, capacity, local kv heads * Dh] f32.
struct InferenceWorker::KvCache {
  int64_t capacity = 0, width = 0;
  std::vector<Tensor> k, v;
  std::vector<int64_t> length;  // tokens cached per row
  KvCache(int64_t layers, int64_t rows, int64_t capacity_, int64_t width_)
      : capacity(capacity_), width(width_), length(size_t(rows), 0) {
    for (int64_t l = 0; l < layers; ++l) {
      k.push_back(Tensor::empty(DType::kF32, {rows, capacity, width}));
      v.push_back(Tensor::empty(DType::kF32, {rows, capacity, width}));
    }
  }
};

namespace {

Tensor f32(Shape s) { return Tensor::empty(DType::kF32, std::move(s)); }

// A bf16 norm gain widened to f32 (norm kernels take f32 gains).
void widen(const uint16_t* g, int64_t n, std::vector<float>& out) {
  out.resize(size_t(n));
  convert_bf16_to_f32(g, out.data(), size_t(n));
}

// y += x, element-wise.
void add_into(float* y, const float* x, int64_t n) {
  parallel_for(n, int64_t(1) << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] += x[i];
  });
}

}  // namespace

InferenceWorker::InferenceWorker(WorkerOptions options) : options_(std::move(options)) {}
InferenceWorker::~InferenceWorker() = default;

Result<std::unique_ptr<InferenceWorker>> InferenceWorker::create(WorkerOptions o) {
  WL_RETURN_IF_ERROR(o.config.validate("inference worker: config"));
  WL_RETURN_IF_ERROR(transfer::inference_layout(o.config, o.layout).status());
  const int tp = o.layout.tp;
  if (tp > 1) {
    if (!o.tp_group) {
      return invalid_argument("inference worker: tp " + std::to_string(tp) +
                              " needs a TP group (WorkerOptions::tp_group)");
    }
    if (o.tp_group->size() != tp || o.tp_group->rank() != o.layout.tp_rank) {
      return invalid_argument("inference worker: the TP group is rank " +
                              std::to_string(o.tp_group->rank()) + " of " +
                              std::to_string(o.tp_group->size()) + ", the layout says tp rank " +
                              std::to_string(o.layout.tp_rank) + " of " + std::to_string(tp));
    }
  }
  std::unique_ptr<InferenceWorker> w(new InferenceWorker(std::move(o)));
  const model::ModelConfig& c = w->options_.config;
  w->rope_ = model::make_rope_table(c);
  w->local_heads_ = c.num_heads / tp;
  w->local_kv_heads_ = c.num_kv_heads >= tp ? c.num_kv_heads / tp : 1;
  w->local_ffn_ = c.ffn_dim / tp;
  return w;
}

Result<BoundWeights> InferenceWorker::bind(const TensorLookup& lookup) const {
  return bind_weights(options_.config, options_.layout, lookup);
}

Status InferenceWorker::allreduce_sum(float* data, size_t count) {
  if (options_.layout.tp == 1) return ok_status();
  Status s = comm::allreduce(*options_.tp_group, {.recv = data,
                                                  .count = count,
                                                  .dtype = DType::kF32,
                                                  .op = comm::ReduceOp::kSum,
                                                  .timeout = options_.timeout});
  if (s.ok()) return s;
  return s.with_context("inference worker (tp rank " + std::to_string(options_.layout.tp_rank) +
                        ")");
}

Status InferenceWorker::check_prompts(const std::vector<std::vector<int64_t>>& prompts,
                                      int64_t new_tokens) const {
  const model::ModelConfig& c = options_.config;
  if (prompts.empty()) return invalid_argument("inference worker: no prompts");
  if (new_tokens < 0) return invalid_argument("inference worker: max_new_tokens must be >= 1");
  for (size_t r = 0; r < prompts.size(); ++r) {
    const std::string row = "inference worker: prompt " + std::to_string(r);
    if (prompts[r].empty()) return invalid_argument(row + " is empty");
    if (int64_t(prompts[r].size()) + new_tokens > c.max_seq_len) {
      return invalid_argument(row + " has " + std::to_string(prompts[r].size()) + " tokens; with " +
                              std::to_string(new_tokens) + " new ones that exceeds max_seq_len " +
                              std::to_string(c.max_seq_len));
    }
    for (int64_t t : prompts[r]) {
      if (t < 0 || t >= c.vocab_size) {
        return invalid_argument(row + " holds token " + std::to_string(t) + " outside [0, " +
                                std::to_string(c.vocab_size) + ")");
      }
    }
  }
  return ok_status();
}

// One forward over the new tokens of every row: the phases of a layer on shared buffers.
class InferenceWorker::ForwardPass {
 public:
  // routes, when not null, receives every new token's experts in every layer:
  // [tokens][num_layers][top_k], the tokens of every row in turn.
  ForwardPass(InferenceWorker& worker, const BoundWeights& w, KvCache& cache,
              const std::vector<std::vector<int64_t>>& feed, std::vector<int32_t>* routes);
  // all_positions false: only each row's last token reaches the head, so the last layer's
  // experts run for those alone (the router still routes every token, for the routes).
  Status run_layers(bool all_positions);
  Result<Tensor> head(bool all_positions);

 private:
  void attention(const BoundLayer& lw, size_t l);
  Status o_proj(const BoundLayer& lw);
  // keep, when not null: the tokens whose output is read (the others' experts do not run).
  Status moe(const BoundLayer& lw, size_t l, const uint8_t* keep);
  Status dense_mlp(const BoundLayer& lw);
  // Rows grouped by expert, token order within one, as the trainer dispatches them (the kept
  // tokens' slots only, when `keep`); returns the rows.
  int64_t dispatch(const uint8_t* keep, std::vector<int64_t>& begin,
                   std::vector<int32_t>& row_of_slot, std::vector<int32_t>& token_of_row);
  Status add_partial();  // tp > 1: allreduce the partial sums, add them into x

  InferenceWorker& wk_;
  const model::ModelConfig& c_;
  const BoundWeights& w_;
  KvCache& cache_;
  const int64_t d_, E_, K_, H_, Hkv_, F_, qd_, kvd_, qkvd_;
  const float eps_;
  const bool tp_;
  std::vector<int64_t> tokens_, row_begin_;  // concatenated new tokens; first index of each row
  int64_t M_ = 0, R_ = 0;
  std::vector<int32_t>* routes_;
  Tensor x_, xn_, qkv_, att_, partial_, logits_r_, probs_, topk_w_, topk_idx_, counts_;
  std::vector<float> gain_, q_gain_, k_gain_;
};

InferenceWorker::ForwardPass::ForwardPass(InferenceWorker& worker, const BoundWeights& w,
                                          KvCache& cache,
                                          const std::vector<std::vector<int64_t>>& feed,
                                          std::vector<int32_t>* routes)
    : wk_(worker),
      c_(worker.options_.config),
      w_(w),
      cache_(cache),
      d_(c_.hidden_size),
      E_(c_.num_experts),
      K_(c_.top_k),
      H_(worker.local_heads_),
      Hkv_(worker.local_kv_heads_),
      F_(worker.local_ffn_),
      qd_(H_ * c_.head_dim),
      kvd_(Hkv_ * c_.head_dim),
      qkvd_(qd_ + 2 * kvd_),
      eps_(float(c_.rms_eps)),
      tp_(worker.options_.layout.tp > 1),
      routes_(routes) {
  for (const auto& f : feed) {
    row_begin_.push_back(int64_t(tokens_.size()));
    tokens_.insert(tokens_.end(), f.begin(), f.end());
  }
  row_begin_.push_back(int64_t(tokens_.size()));
  M_ = int64_t(tokens_.size());
  R_ = int64_t(feed.size());
  x_ = f32({M_, d_});
  for (int64_t i = 0; i < M_; ++i) {
    dequantize_rows(w.embed, tokens_[size_t(i)], tokens_[size_t(i)] + 1, x_.data<float>() + i * d_);
  }
  xn_ = f32({M_, d_});
  qkv_ = f32({M_, qkvd_});
  att_ = f32({M_, qd_});
  if (tp_) partial_ = f32({M_, d_});
  logits_r_ = f32({M_, E_});
  probs_ = f32({M_, E_});
  topk_w_ = f32({M_, K_});
  topk_idx_ = Tensor::empty(DType::kI32, {M_, K_});
  counts_ = Tensor::empty(DType::kI64, {E_});
  if (routes_) routes_->assign(size_t(M_ * c_.num_layers * K_), -1);
}

// Local heads against this rank's cache: q, k and v of the new tokens, k and v appended.
void InferenceWorker::ForwardPass::attention(const BoundLayer& lw, size_t l) {
  widen(lw.attn_norm, d_, gain_);
  kernels::rmsnorm_forward(x_.data<float>(), gain_.data(), xn_.data<float>(), nullptr, M_, d_,
                           eps_);
  dequant_linear(lw.qkv, xn_.data<float>(), M_, qkv_.data<float>(), false, wk_.band_);
  const int64_t Dh = c_.head_dim;
  if (lw.q_norm) {
    widen(lw.q_norm, Dh, q_gain_);
    widen(lw.k_norm, Dh, k_gain_);
  }
  for (int64_t r = 0; r < R_; ++r) {
    const int64_t n = row_begin_[size_t(r) + 1] - row_begin_[size_t(r)];
    const int64_t pos = cache_.length[size_t(r)];
    if (n == 0) continue;
    Tensor q = f32({n, qd_});
    float* kbase = cache_.k[l].data<float>() + r * cache_.capacity * kvd_;
    float* vbase = cache_.v[l].data<float>() + r * cache_.capacity * kvd_;
    for (int64_t t = 0; t < n; ++t) {
      const float* src = qkv_.data<float>() + (row_begin_[size_t(r)] + t) * qkvd_;
      std::memcpy(q.data<float>() + t * qd_, src, size_t(qd_) * 4);
      std::memcpy(kbase + (pos + t) * kvd_, src + qd_, size_t(kvd_) * 4);
      std::memcpy(vbase + (pos + t) * kvd_, src + qd_ + kvd_, size_t(kvd_) * 4);
    }
    if (lw.q_norm) {  // Qwen3's per-head norms, before RoPE (the cache holds normed keys)
      kernels::rmsnorm_forward(q.data<float>(), q_gain_.data(), q.data<float>(), nullptr, n * H_,
                               Dh, eps_);
      kernels::rmsnorm_forward(kbase + pos * kvd_, k_gain_.data(), kbase + pos * kvd_, nullptr,
                               n * Hkv_, Dh, eps_);
    }
    kernels::rope_forward(q.data<float>(), wk_.rope_, 1, n, H_, pos);
    kernels::rope_forward(kbase + pos * kvd_, wk_.rope_, 1, n, Hkv_, pos);
    kernels::attention_forward({.batch = 1,
                                .seq_q = n,
                                .seq_kv = pos + n,
                                .heads = H_,
                                .kv_heads = Hkv_,
                                .head_dim = Dh,
                                .q_offset = pos},
                               q.data<float>(), kbase, vbase,
                               att_.data<float>() + row_begin_[size_t(r)] * qd_, nullptr);
  }
}

Status InferenceWorker::ForwardPass::add_partial() {
  WL_RETURN_IF_ERROR(wk_.allreduce_sum(partial_.data<float>(), size_t(M_ * d_)));
  add_into(x_.data<float>(), partial_.data<float>(), M_ * d_);
  return ok_status();
}

// Row parallel: at tp > 1 each rank's partial sums, then the allreduce.
Status InferenceWorker::ForwardPass::o_proj(const BoundLayer& lw) {
  if (!tp_) {
    dequant_linear(lw.o, att_.data<float>(), M_, x_.data<float>(), true, wk_.band_);
    return ok_status();
  }
  dequant_linear(lw.o, att_.data<float>(), M_, partial_.data<float>(), false, wk_.band_);
  return add_partial();
}

int64_t InferenceWorker::ForwardPass::dispatch(const uint8_t* keep, std::vector<int64_t>& begin,
                                               std::vector<int32_t>& row_of_slot,
                                               std::vector<int32_t>& token_of_row) {
  begin.assign(size_t(E_ + 1), 0);
  row_of_slot.resize(size_t(M_ * K_));
  token_of_row.resize(size_t(M_ * K_));
  const kernels::RouterShape rs{.tokens = M_, .experts = E_, .top_k = K_};
  return kernels::group_by_expert(rs, topk_idx_.data<int32_t>(), keep, begin.data(),
                                  row_of_slot.data(), token_of_row.data());
}

// A dense layer's MLP over every token (xn_ already normed): this rank's Fd/tp rows.
Status InferenceWorker::ForwardPass::dense_mlp(const BoundLayer& lw) {
  const int64_t f = lw.mlp.down.cols;
  Tensor he = f32({M_, 2 * f}), ae = f32({M_, f});
  dequant_linear(lw.mlp.gate_up, xn_.data<float>(), M_, he.data<float>(), false, wk_.band_);
  kernels::swiglu_forward(he.data<float>(), ae.data<float>(), M_, f);
  if (!tp_) {
    dequant_linear(lw.mlp.down, ae.data<float>(), M_, x_.data<float>(), true, wk_.band_);
    return ok_status();
  }
  dequant_linear(lw.mlp.down, ae.data<float>(), M_, partial_.data<float>(), false, wk_.band_);
  return add_partial();
}

// The replicated router, then this rank's ffn rows of every expert, combined by gate weight;
// or a dense layer's MLP.
Status InferenceWorker::ForwardPass::moe(const BoundLayer& lw, size_t l, const uint8_t* keep) {
  widen(lw.moe_norm, d_, gain_);
  kernels::rmsnorm_forward(x_.data<float>(), gain_.data(), xn_.data<float>(), nullptr, M_, d_,
                           eps_);
  if (lw.dense()) return dense_mlp(lw);
  dequant_linear(lw.router, xn_.data<float>(), M_, logits_r_.data<float>(), false, wk_.band_);
  kernels::router_forward({.tokens = M_, .experts = E_, .top_k = K_, .norm_topk = c_.norm_topk},
                          logits_r_.data<float>(), probs_.data<float>(), topk_idx_.data<int32_t>(),
                          topk_w_.data<float>(), nullptr, counts_.data<int64_t>());
  if (routes_) {
    const int32_t* idx = topk_idx_.data<int32_t>();
    const int64_t stride = c_.num_layers * K_;
    for (int64_t t = 0; t < M_; ++t) {
      std::copy(idx + t * K_, idx + (t + 1) * K_, routes_->data() + t * stride + int64_t(l) * K_);
    }
  }
  std::vector<int64_t> begin;
  std::vector<int32_t> row_of_slot, token_of_row;
  const int64_t S = dispatch(keep, begin, row_of_slot, token_of_row);
  Tensor xe = f32({S, d_}), he = f32({S, 2 * F_}), ae = f32({S, F_}), ye = f32({S, d_});
  for (int64_t s = 0; s < S; ++s) {
    std::memcpy(xe.data<float>() + s * d_, xn_.data<float>() + token_of_row[size_t(s)] * d_,
                size_t(d_) * 4);
  }
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t r0 = begin[size_t(e)], n = begin[size_t(e + 1)] - r0;
    if (n == 0) continue;
    const BoundExpert& ex = lw.experts[size_t(e)];
    dequant_linear(ex.gate_up, xe.data<float>() + r0 * d_, n, he.data<float>() + r0 * 2 * F_, false,
                   wk_.band_);
    kernels::swiglu_forward(he.data<float>() + r0 * 2 * F_, ae.data<float>() + r0 * F_, n, F_);
    dequant_linear(ex.down, ae.data<float>() + r0 * F_, n, ye.data<float>() + r0 * d_, false,
                   wk_.band_);
  }
  // Combine: at tp 1 straight into x (the trainer's order); else partial sums first.
  float* combine = tp_ ? partial_.data<float>() : x_.data<float>();
  if (tp_) partial_.fill_zero();
  parallel_for(M_, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = combine + t * d_;
      for (int64_t k = 0; k < K_; ++k) {
        const int32_t row = row_of_slot[size_t(t * K_ + k)];
        if (row < 0) continue;  // a token nothing reads
        const float g = topk_w_.data<float>()[t * K_ + k];
        const float* y = ye.data<float>() + int64_t(row) * d_;
        for (int64_t i = 0; i < d_; ++i) o[i] += g * y[i];
      }
    }
  });
  return tp_ ? add_partial() : ok_status();
}

Status InferenceWorker::ForwardPass::run_layers(bool all_positions) {
  std::vector<uint8_t> last_tokens;  // of each row: what the head reads
  if (!all_positions) {
    last_tokens.assign(size_t(M_), 0);
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t end = row_begin_[size_t(r) + 1];
      if (end > row_begin_[size_t(r)]) last_tokens[size_t(end - 1)] = 1;
    }
  }
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    attention(w_.layers[l], l);
    WL_RETURN_IF_ERROR(o_proj(w_.layers[l]));
    const bool last = l + 1 == w_.layers.size();
    WL_RETURN_IF_ERROR(moe(w_.layers[l], l, last && !all_positions ? last_tokens.data() : nullptr));
  }
  for (int64_t r = 0; r < R_; ++r) {
    cache_.length[size_t(r)] += row_begin_[size_t(r) + 1] - row_begin_[size_t(r)];
  }
  return ok_status();
}

// The final norm and the head: every position, or each row's last.
Result<Tensor> InferenceWorker::ForwardPass::head(bool all_positions) {
  Tensor last;
  if (all_positions) {
    last = x_;
  } else {
    last = Tensor::zeros(DType::kF32, {R_, d_});
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t end = row_begin_[size_t(r) + 1];
      if (end > row_begin_[size_t(r)]) {
        std::memcpy(last.data<float>() + r * d_, x_.data<float>() + (end - 1) * d_, size_t(d_) * 4);
      }
    }
  }
  const int64_t n = last.size(0);
  Tensor ln = f32({n, d_}), logits = f32({n, c_.vocab_size});
  widen(w_.norm, d_, gain_);
  kernels::rmsnorm_forward(last.data<float>(), gain_.data(), ln.data<float>(), nullptr, n, d_,
                           eps_);
  dequant_linear(w_.head, ln.data<float>(), n, logits.data<float>(), false, wk_.band_);
  return logits;
}

Result<Tensor> InferenceWorker::forward(const BoundWeights& w, KvCache& cache,
                                        const std::vector<std::vector<int64_t>>& feed,
                                        bool all_positions, std::vector<int32_t>* routes) {
  ForwardPass pass(*this, w, cache, feed, routes);
  WL_RETURN_IF_ERROR(pass.run_layers(all_positions));
  return pass.head(all_positions);
}

Result<std::vector<Tensor>> InferenceWorker::prompt_logits(
    const BoundWeights& w, const std::vector<std::vector<int64_t>>& prompts) {
  WL_RETURN_IF_ERROR(check_prompts(prompts, 0));
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, int64_t(p.size()));
  KvCache cache(options_.config.num_layers, int64_t(prompts.size()), longest,
                local_kv_heads_ * options_.config.head_dim);
  WL_ASSIGN_OR_RETURN(Tensor all, forward(w, cache, prompts, true));
  std::vector<Tensor> out;
  int64_t row = 0;
  for (const auto& p : prompts) {
    out.push_back(all.slice(0, row, row + int64_t(p.size())).clone());
    row += int64_t(p.size());
  }
  return out;
}

Result<Generation> InferenceWorker::generate(const BoundWeights& w,
                                             const std::vector<std::vector<int64_t>>& prompts,
                                             const GenerateOptions& o) {
  const model::ModelConfig& c = options_.config;
  if (o.max_new_tokens < 1) {
    return invalid_argument("inference worker: max_new_tokens is " +
                            std::to_string(o.max_new_tokens) + ", must be >= 1");
  }
  WL_RETURN_IF_ERROR(check_prompts(prompts, o.max_new_tokens));
  const size_t R = prompts.size();
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, int64_t(p.size()));
  KvCache cache(c.num_layers, int64_t(R), longest + o.max_new_tokens, local_kv_heads_ * c.head_dim);
  model::RowSampler sampler(R, o.sampling, o.seed, o.stop_token);
  Generation g;
  if (o.keep_logits) g.logits.assign(R, {});
  if (o.keep_routes) g.routes.assign(R, {});
  const size_t per_token = size_t(c.num_layers * c.top_k);
  std::vector<int32_t> routes;
  std::vector<std::vector<int64_t>> feed = prompts;
  Stopwatch clock;  // the prefill (step 0), then the decode steps
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    WL_ASSIGN_OR_RETURN(Tensor logits,
                        forward(w, cache, feed, false, o.keep_routes ? &routes : nullptr));
    for (size_t r = 0, at = 0; r < R && o.keep_routes; at += feed[r].size(), ++r) {
      g.routes[r].insert(g.routes[r].end(), routes.begin() + int64_t(at * per_token),
                         routes.begin() + int64_t((at + feed[r].size()) * per_token));
    }
    const float* all = logits.data<float>();
    const size_t V = size_t(c.vocab_size);
    for (size_t r = 0; r < R && o.keep_logits; ++r) {
      if (!sampler.stopped(r)) g.logits[r].emplace_back(all + r * V, all + (r + 1) * V);
    }
    const bool all_stopped = sampler.step(all, c.vocab_size, feed);
    if (step == 0) {
      g.prefill_seconds = clock.seconds();
      clock.restart();
    }
    if (all_stopped) break;
  }
  g.tokens = sampler.take_tokens();
  g.logprobs = sampler.take_logprobs();
  g.decode_seconds = clock.seconds();
  return g;
}

Result<Generation> InferenceWorker::generate(const transfer::Receiver& receiver,
                                             const std::vector<std::vector<int64_t>>& prompts,
                                             const GenerateOptions& o) {
  const int tp = options_.layout.tp;
  const std::chrono::milliseconds timeout = options_.timeout.count() > 0 ? options_.timeout
                                            : tp > 1 ? options_.tp_group->default_timeout()
                                                     : std::chrono::milliseconds(0);
  const auto deadline = Clock::now() + timeout;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    transfer::Receiver::ReadGuard guard = receiver.acquire();
    Result<BoundWeights> w = bind(lookup_in(receiver, guard));
    if (tp > 1) {
      // One allreduce(max) settles it for every rank alike: the highest and lowest version
      // held, whether some rank could not bind its weights, whether some rank is out of time.
      const int64_t v = int64_t(guard.version());
      int64_t agree[4] = {v, -v, w.ok() ? 0 : 1, Clock::now() > deadline ? 1 : 0};
      Status s = comm::allreduce(*options_.tp_group, {.recv = agree,
                                                      .count = 4,
                                                      .dtype = DType::kI64,
                                                      .op = comm::ReduceOp::kMax,
                                                      .timeout = options_.timeout});
      if (!s.ok()) {
        return s.with_context("inference worker (tp rank " +
                              std::to_string(options_.layout.tp_rank) + "): agreeing on a version");
      }
      if (!w.ok()) return w.status();
      if (agree[2] != 0) {
        return failed_precondition("inference worker (tp rank " +
                                   std::to_string(options_.layout.tp_rank) +
                                   "): another TP rank could not bind its weights");
      }
      if (agree[0] != -agree[1]) {
        if (agree[3] != 0) {
          return deadline_exceeded(
              "inference worker (tp rank " + std::to_string(options_.layout.tp_rank) +
              "): TP ranks still hold weight versions " + std::to_string(-agree[1]) + " to " +
              std::to_string(agree[0]) + " after " + std::to_string(timeout.count()) + " ms");
        }
        continue;  // releases the guard; a lagging receiver publishes soon after the barrier
      }
    }
    if (!w.ok()) return w.status();
    WL_ASSIGN_OR_RETURN(Generation g, generate(*w, prompts, o));
    g.version = guard.version();
    return g;
  }
}

}  // namespace wl::infer
