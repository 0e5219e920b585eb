// The inference worker of worker.h: a KV-cached forward pass over one TP rank's shard of the
// inference layout, two allreduces per block, and the decoding loop around it.
#include "weightlift/infer/worker.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "weightlift/comm/allreduce.h"
#include "weightlift/core/parallel.h"
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
  w->rope_ = kernels::make_rope_table(c.max_seq_len, c.head_dim, c.rope_theta, c.rope_ntk_alpha);
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
  Status s = comm::allreduce(*options_.tp_group, {.recv = data, .count = count,
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
      return invalid_argument(row + " has " + std::to_string(prompts[r].size()) +
                              " tokens; with " + std::to_string(new_tokens) +
                              " new ones that exceeds max_seq_len " +
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

Result<Tensor> InferenceWorker::forward(const BoundWeights& w, KvCache& cache,
                                        const std::vector<std::vector<int64_t>>& feed,
                                        bool all_positions) {
  const model::ModelConfig& c = options_.config;
  const int64_t d = c.hidden_size, V = c.vocab_size, Dh = c.head_dim, E = c.num_experts,
                K = c.top_k;
  const int64_t H = local_heads_, Hkv = local_kv_heads_, F = local_ffn_;
  const int64_t qd = H * Dh, kvd = Hkv * Dh, qkvd = qd + 2 * kvd;
  const float eps = float(c.rms_eps);
  const bool tp = options_.layout.tp > 1;
  std::vector<int64_t> tokens, row_begin;  // concatenated new tokens; first index of each row
  for (const auto& f : feed) {
    row_begin.push_back(int64_t(tokens.size()));
    tokens.insert(tokens.end(), f.begin(), f.end());
  }
  row_begin.push_back(int64_t(tokens.size()));
  const int64_t M = int64_t(tokens.size()), R = int64_t(feed.size());

  Tensor x = f32({M, d});
  for (int64_t i = 0; i < M; ++i) {
    dequantize_rows(w.embed, tokens[size_t(i)], tokens[size_t(i)] + 1, x.data<float>() + i * d);
  }
  Tensor xn = f32({M, d}), qkv = f32({M, qkvd}), att = f32({M, qd});
  Tensor partial = tp ? f32({M, d}) : Tensor();
  Tensor logits_r = f32({M, E}), probs = f32({M, E}), topk_w = f32({M, K});
  Tensor topk_idx = Tensor::empty(DType::kI32, {M, K}), counts = Tensor::empty(DType::kI64, {E});
  std::vector<float> gain;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const BoundLayer& lw = w.layers[l];
    // ---- attention: local heads against this rank's cache ----
    widen(lw.attn_norm, d, gain);
    kernels::rmsnorm_forward(x.data<float>(), gain.data(), xn.data<float>(), nullptr, M, d, eps);
    dequant_linear(lw.qkv, xn.data<float>(), M, qkv.data<float>(), false, band_);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = row_begin[size_t(r) + 1] - row_begin[size_t(r)];
      const int64_t pos = cache.length[size_t(r)];
      if (n == 0) continue;
      Tensor q = f32({n, qd});
      float* kbase = cache.k[l].data<float>() + r * cache.capacity * kvd;
      float* vbase = cache.v[l].data<float>() + r * cache.capacity * kvd;
      for (int64_t t = 0; t < n; ++t) {
        const float* src = qkv.data<float>() + (row_begin[size_t(r)] + t) * qkvd;
        std::memcpy(q.data<float>() + t * qd, src, size_t(qd) * 4);
        std::memcpy(kbase + (pos + t) * kvd, src + qd, size_t(kvd) * 4);
        std::memcpy(vbase + (pos + t) * kvd, src + qd + kvd, size_t(kvd) * 4);
      }
      kernels::rope_forward(q.data<float>(), rope_, 1, n, H, pos);
      kernels::rope_forward(kbase + pos * kvd, rope_, 1, n, Hkv, pos);
      kernels::attention_forward({.batch = 1, .seq_q = n, .seq_kv = pos + n, .heads = H,
                                  .kv_heads = Hkv, .head_dim = Dh, .q_offset = pos},
                                 q.data<float>(), kbase, vbase,
                                 att.data<float>() + row_begin[size_t(r)] * qd, nullptr);
    }
    // ---- o_proj, row parallel: partial sums, then the allreduce ----
    if (!tp) {
      dequant_linear(lw.o, att.data<float>(), M, x.data<float>(), true, band_);
    } else {
      dequant_linear(lw.o, att.data<float>(), M, partial.data<float>(), false, band_);
      WL_RETURN_IF_ERROR(allreduce_sum(partial.data<float>(), size_t(M * d)));
      add_into(x.data<float>(), partial.data<float>(), M * d);
    }

    // ---- MoE: replicated router, this rank's ffn rows of every expert ----
    widen(lw.moe_norm, d, gain);
    kernels::rmsnorm_forward(x.data<float>(), gain.data(), xn.data<float>(), nullptr, M, d, eps);
    dequant_linear(lw.router, xn.data<float>(), M, logits_r.data<float>(), false, band_);
    kernels::router_forward({.tokens = M, .experts = E, .top_k = K, .norm_topk = c.norm_topk},
                            logits_r.data<float>(), probs.data<float>(),
                            topk_idx.data<int32_t>(), topk_w.data<float>(), nullptr,
                            counts.data<int64_t>());
    // Dispatch as the trainer does: rows grouped by expert, token order within one.
    const int64_t S = M * K;
    std::vector<int64_t> begin(size_t(E + 1), 0);
    for (int64_t e = 0; e < E; ++e) begin[size_t(e + 1)] = begin[size_t(e)] + counts.data<int64_t>()[e];
    std::vector<int32_t> row_of_slot(static_cast<size_t>(S)), token_of_row(static_cast<size_t>(S));
    {
      std::vector<int64_t> cursor(begin.begin(), begin.end() - 1);
      const int32_t* idx = topk_idx.data<int32_t>();
      for (int64_t t = 0; t < M; ++t) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t row = cursor[size_t(idx[t * K + k])]++;
          row_of_slot[size_t(t * K + k)] = int32_t(row);
          token_of_row[size_t(row)] = int32_t(t);
        }
      }
    }
    Tensor xe = f32({S, d}), he = f32({S, 2 * F}), ae = f32({S, F}), ye = f32({S, d});
    for (int64_t s = 0; s < S; ++s) {
      std::memcpy(xe.data<float>() + s * d, xn.data<float>() + token_of_row[size_t(s)] * d,
                  size_t(d) * 4);
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = begin[size_t(e)], n = begin[size_t(e + 1)] - r0;
      if (n == 0) continue;
      const BoundExpert& ex = lw.experts[size_t(e)];
      dequant_linear(ex.gate_up, xe.data<float>() + r0 * d, n, he.data<float>() + r0 * 2 * F,
                     false, band_);
      kernels::swiglu_forward(he.data<float>() + r0 * 2 * F, ae.data<float>() + r0 * F, n, F);
      dequant_linear(ex.down, ae.data<float>() + r0 * F, n, ye.data<float>() + r0 * d, false,
                     band_);
    }
    // Combine: at tp 1 straight into x (the trainer's order); else partial sums first.
    float* combine = tp ? partial.data<float>() : x.data<float>();
    if (tp) partial.fill_zero();
    parallel_for(M, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* o = combine + t * d;
        for (int64_t k = 0; k < K; ++k) {
          const float g = topk_w.data<float>()[t * K + k];
          const float* y = ye.data<float>() + int64_t(row_of_slot[size_t(t * K + k)]) * d;
          for (int64_t i = 0; i < d; ++i) o[i] += g * y[i];
        }
      }
    });
    if (tp) {
      WL_RETURN_IF_ERROR(allreduce_sum(partial.data<float>(), size_t(M * d)));
      add_into(x.data<float>(), partial.data<float>(), M * d);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    cache.length[size_t(r)] += row_begin[size_t(r) + 1] - row_begin[size_t(r)];
  }

  // ---- final norm and head: every position, or each row's last ----
  Tensor last;
  if (all_positions) {
    last = x;
  } else {
    last = Tensor::zeros(DType::kF32, {R, d});
    for (int64_t r = 0; r < R; ++r) {
      const int64_t end = row_begin[size_t(r) + 1];
      if (end > row_begin[size_t(r)]) {
        std::memcpy(last.data<float>() + r * d, x.data<float>() + (end - 1) * d, size_t(d) * 4);
      }
    }
  }
  const int64_t n = last.size(0);
  Tensor ln = f32({n, d}), logits = f32({n, V});
  widen(w.norm, d, gain);
  kernels::rmsnorm_forward(last.data<float>(), gain.data(), ln.data<float>(), nullptr, n, d, eps);
  dequant_linear(w.head, ln.data<float>(), n, logits.data<float>(), false, band_);
  return logits;
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
  KvCache cache(c.num_layers, int64_t(R), longest + o.max_new_tokens,
                local_kv_heads_ * c.head_dim);
  model::RowSampler sampler(R, o.sampling, o.seed, o.stop_token);
  Generation g;
  if (o.keep_logits) g.logits.assign(R, {});
  std::vector<std::vector<int64_t>> feed = prompts;
  auto t0 = Clock::now();
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    WL_ASSIGN_OR_RETURN(Tensor logits, forward(w, cache, feed, false));
    const float* all = logits.data<float>();
    const size_t V = size_t(c.vocab_size);
    for (size_t r = 0; r < R && o.keep_logits; ++r) {
      if (!sampler.stopped(r)) g.logits[r].emplace_back(all + r * V, all + (r + 1) * V);
    }
    const bool all_stopped = sampler.step(all, c.vocab_size, feed);
    if (step == 0) {
      g.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      t0 = Clock::now();
    }
    if (all_stopped) break;
  }
  g.tokens = sampler.take_tokens();
  g.decode_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return g;
}

Result<Generation> InferenceWorker::generate(const transfer::Receiver& receiver,
                                             const std::vector<std::vector<int64_t>>& prompts,
                                             const GenerateOptions& o) {
  const int tp = options_.layout.tp;
  const std::chrono::milliseconds timeout =
      options_.timeout.count() > 0 ? options_.timeout
      : tp > 1                     ? options_.tp_group->default_timeout()
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
      Status s = comm::allreduce(*options_.tp_group,
                                 {.recv = agree, .count = 4, .dtype = DType::kI64,
                                  .op = comm::ReduceOp::kMax, .timeout = options_.timeout});
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
          return deadline_exceeded("inference worker (tp rank " +
                                   std::to_string(options_.layout.tp_rank) +
                                   "): TP ranks still hold weight versions " +
                                   std::to_string(-agree[1]) + " to " +
                                   std::to_string(agree[0]) + " after " +
                                   std::to_string(timeout.count()) + " ms");
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
