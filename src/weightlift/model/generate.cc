#include "weightlift/model/generate.h"

#include <algorithm>
#include <cstring>

#include "weightlift/core/parallel.h"
#include "weightlift/core/timing.h"
#include "weightlift/kernels/attention.h"
#include "weightlift/kernels/embedding.h"
#include "weightlift/kernels/rmsnorm.h"
#include "weightlift/kernels/rope.h"
#include "weightlift/model/detail/block.h"
#include "weightlift/model/detail/linear.h"

namespace wl::model {
namespace {

// Keys and values of every layer for every row: [layers][rows, capacity, Hkv * Dh].
struct KvCache {
  int64_t rows, capacity, width;
  std::vector<Tensor> k, v;
  std::vector<int64_t> length;  // tokens cached per row
  KvCache(const ModelConfig& c, int64_t rows_)
      : rows(rows_), capacity(c.max_seq_len), width(c.kv_dim()), length(size_t(rows_), 0) {
    for (int64_t l = 0; l < c.num_layers; ++l) {
      k.push_back(Tensor::empty(DType::kF32, {rows, capacity, width}));
      v.push_back(Tensor::empty(DType::kF32, {rows, capacity, width}));
    }
  }
  void clear() { std::fill(length.begin(), length.end(), 0); }
};

// The logits [rows, V] of each row's last new token in x [M, d] (row r's new tokens at
// [row_begin[r], row_begin[r + 1])): only those positions need the final norm and head. A row
// with nothing new gets zeros.
std::vector<float> head_of_last(Transformer& model, const Tensor& x,
                                const std::vector<int64_t>& row_begin, Precision prec,
                                WeightCopies* copies) {
  const ModelConfig& c = model.config();
  const int64_t d = c.hidden_size, V = c.vocab_size;
  const ModelView w = model.param_view();
  const int64_t R = int64_t(row_begin.size()) - 1;
  Tensor last = Tensor::zeros(DType::kF32, {R, d});
  for (int64_t r = 0; r < R; ++r) {
    if (row_begin[size_t(r) + 1] > row_begin[size_t(r)])
      std::memcpy(last.data<float>() + r * d, x.data<float>() + (row_begin[size_t(r) + 1] - 1) * d,
                  size_t(d) * 4);
  }
  Tensor ln = Tensor::empty(DType::kF32, {R, d});
  kernels::rmsnorm_forward(last.data<float>(), w.norm, ln.data<float>(), nullptr, R, d,
                           float(c.rms_eps));
  std::vector<float> logits(size_t(R * V));
  detail::linear_forward(prec, ln.data<float>(), {w.head, copies, {.role = ParamRole::kHead}},
                         logits.data(), R, d, V);
  return logits;
}

// Runs new tokens through the model: row r appends feed[r] (may be empty) to its cache.
// Returns the logits of each row's last new token, [rows, V] (rows with nothing new: zeros).
std::vector<float> forward_cached(Transformer& model, KvCache& cache,
                                  const std::vector<std::vector<int64_t>>& feed, Precision prec,
                                  WeightCopies* copies) {
  const ModelConfig& c = model.config();
  const int64_t d = c.hidden_size, V = c.vocab_size, H = c.num_heads, Hkv = c.num_kv_heads;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim(), qkvd = qd + 2 * kvd;
  std::vector<int64_t> tokens, row_begin;  // concatenated new tokens; first index of each row
  for (const auto& f : feed) {
    row_begin.push_back(int64_t(tokens.size()));
    tokens.insert(tokens.end(), f.begin(), f.end());
  }
  row_begin.push_back(int64_t(tokens.size()));
  const int64_t M = int64_t(tokens.size());
  ModelView w = model.param_view();
  detail::BlockContext ctx{c, model.rope(), prec};
  ctx.weight_copies = copies;
  // Drops over this pass's tokens, as the rollout engines do (docs/algorithms.md).
  ctx.capacity_factor = c.capacity_factor.value_or(0.0);

  Tensor x = Tensor::empty(DType::kF32, {M, d});
  kernels::embedding_forward(w.embed, tokens.data(), x.data<float>(), M, V, d);
  Tensor xn = Tensor::empty(DType::kF32, {M, d}), qkv = Tensor::empty(DType::kF32, {M, qkvd});
  Tensor att = Tensor::empty(DType::kF32, {M, qd});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerView& lw = w.layers[size_t(l)];
    ctx.layer = int(l);
    kernels::rmsnorm_forward(x.data<float>(), lw.attn_norm, xn.data<float>(), nullptr, M, d,
                             float(c.rms_eps));
    detail::linear_forward(prec, xn.data<float>(), {lw.wqkv, copies, {int(l), ParamRole::kQ}},
                           qkv.data<float>(), M, d, qkvd);
    for (size_t r = 0; r < feed.size(); ++r) {
      const int64_t n = row_begin[r + 1] - row_begin[r], pos = cache.length[r];
      if (n == 0) continue;
      Tensor q = Tensor::empty(DType::kF32, {n, qd});
      float* kc = cache.k[size_t(l)].data<float>() + (int64_t(r) * cache.capacity + pos) * kvd;
      float* vc = cache.v[size_t(l)].data<float>() + (int64_t(r) * cache.capacity + pos) * kvd;
      for (int64_t t = 0; t < n; ++t) {
        const float* src = qkv.data<float>() + (row_begin[r] + t) * qkvd;
        std::memcpy(q.data<float>() + t * qd, src, size_t(qd) * 4);
        std::memcpy(kc + t * kvd, src + qd, size_t(kvd) * 4);
        std::memcpy(vc + t * kvd, src + qd + kvd, size_t(kvd) * 4);
      }
      if (lw.q_norm) {  // Qwen3's per-head norms, in place, before RoPE
        kernels::rmsnorm_forward(q.data<float>(), lw.q_norm, q.data<float>(), nullptr, n * H,
                                 c.head_dim, float(c.rms_eps));
        kernels::rmsnorm_forward(kc, lw.k_norm, kc, nullptr, n * Hkv, c.head_dim, float(c.rms_eps));
      }
      kernels::rope_forward(q.data<float>(), model.rope(), 1, n, H, pos);
      kernels::rope_forward(kc, model.rope(), 1, n, Hkv, pos);
      const float* kbase = cache.k[size_t(l)].data<float>() + int64_t(r) * cache.capacity * kvd;
      const float* vbase = cache.v[size_t(l)].data<float>() + int64_t(r) * cache.capacity * kvd;
      kernels::attention_forward({.batch = 1,
                                  .seq_q = n,
                                  .seq_kv = pos + n,
                                  .heads = H,
                                  .kv_heads = Hkv,
                                  .head_dim = c.head_dim,
                                  .q_offset = pos},
                                 q.data<float>(), kbase, vbase,
                                 att.data<float>() + row_begin[r] * qd, nullptr);
    }
    detail::linear_forward(prec, att.data<float>(), {lw.wo, copies, {int(l), ParamRole::kO}},
                           x.data<float>(), M, qd, d, true);
    detail::BlockActs a;
    a.xn2 = Tensor::empty(DType::kF32, {M, d});
    kernels::rmsnorm_forward(x.data<float>(), lw.moe_norm, a.xn2.data<float>(), nullptr, M, d,
                             float(c.rms_eps));
    Tensor out = Tensor::empty(DType::kF32, {M, d});
    detail::moe_forward(ctx, lw, M, a, x.data<float>(), out.data<float>(), nullptr);
    x = out;
  }
  for (size_t r = 0; r < feed.size(); ++r) cache.length[r] += row_begin[r + 1] - row_begin[r];

  return head_of_last(model, x, row_begin, prec, copies);
}

Status check_prompts(const ModelConfig& c, const std::vector<std::vector<int64_t>>& prompts,
                     int64_t new_tokens) {
  if (prompts.empty()) return invalid_argument("generate: no prompts");
  if (new_tokens < 0) return invalid_argument("generate: max_new_tokens must be >= 1");
  for (size_t r = 0; r < prompts.size(); ++r) {
    if (prompts[r].empty())
      return invalid_argument("generate: prompt " + std::to_string(r) + " is empty");
    if (int64_t(prompts[r].size()) + new_tokens > c.max_seq_len)
      return invalid_argument("generate: prompt " + std::to_string(r) + " has " +
                              std::to_string(prompts[r].size()) + " tokens; with " +
                              std::to_string(new_tokens) + " new ones that exceeds max_seq_len " +
                              std::to_string(c.max_seq_len));
    for (int64_t t : prompts[r])
      if (t < 0 || t >= c.vocab_size)
        return invalid_argument("generate: prompt " + std::to_string(r) + " holds token " +
                                std::to_string(t) + " outside [0, " + std::to_string(c.vocab_size) +
                                ")");
  }
  return ok_status();
}

}  // namespace

RowSampler::RowSampler(size_t rows, const kernels::SamplingOptions& sampling, uint64_t seed,
                       int64_t stop_token)
    : sampling_(sampling),
      stop_token_(stop_token),
      stopped_(rows, false),
      tokens_(rows),
      logprobs_(rows) {
  for (size_t r = 0; r < rows; ++r) rngs_.emplace_back(seed + r);
}

int64_t sampling_grain(int64_t vocab) {
  return std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, vocab));
}

bool RowSampler::pick(size_t row, const float* logits, int64_t vocab) {
  double logprob = 0;
  const int64_t next = sampling_.temperature <= 0
                           ? kernels::argmax(logits, vocab)
                           : kernels::sample(logits, vocab, sampling_, rngs_[row], &logprob);
  tokens_[row].push_back(next);
  logprobs_[row].push_back(logprob);
  if (next != stop_token_) return false;
  stopped_[row] = 1;
  return true;
}

bool RowSampler::step(const float* logits, int64_t vocab, std::vector<std::vector<int64_t>>& feed) {
  parallel_for(int64_t(tokens_.size()), sampling_grain(vocab), [&](int64_t r0, int64_t r1) {
    for (size_t r = size_t(r0); r < size_t(r1); ++r) {
      feed[r].clear();
      if (stopped_[r]) continue;
      if (!pick(r, logits + r * size_t(vocab), vocab)) feed[r].push_back(tokens_[r].back());
    }
  });
  return std::all_of(stopped_.begin(), stopped_.end(), [](uint8_t s) { return s != 0; });
}

Result<Generation> generate(Transformer& model, const std::vector<std::vector<int64_t>>& prompts,
                            const GenerateOptions& o) {
  const ModelConfig& c = model.config();
  if (o.max_new_tokens < 1)
    return invalid_argument("generate: max_new_tokens is " + std::to_string(o.max_new_tokens) +
                            ", must be >= 1");
  WL_RETURN_IF_ERROR(check_prompts(c, prompts, o.max_new_tokens));
  const size_t R = prompts.size();
  KvCache cache(c, int64_t(R));
  RowSampler sampler(R, o.sampling, o.seed, o.stop_token);
  Generation g;
  std::vector<std::vector<int64_t>> feed = prompts;
  WeightCopies copies;  // the weights hold still for the whole generation
  copies.open();
  Stopwatch clock;  // the prefill (step 0), then the decode steps
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    if (!o.use_kv_cache) {  // recompute every running row's whole prefix
      cache.clear();
      for (size_t r = 0; r < R; ++r) {
        if (sampler.stopped(r)) continue;
        feed[r] = prompts[r];
        feed[r].insert(feed[r].end(), sampler.tokens()[r].begin(), sampler.tokens()[r].end());
      }
    }
    const std::vector<float> logits = forward_cached(model, cache, feed, o.precision, &copies);
    bool all_stopped = sampler.step(logits.data(), c.vocab_size, feed);
    for (size_t r = 0; r < R && o.stop_when && !all_stopped; ++r) {
      if (sampler.stopped(r) || !o.stop_when(r, sampler.tokens()[r])) continue;
      sampler.stop(r);
      feed[r].clear();
    }
    if (o.stop_when) {
      all_stopped = true;
      for (size_t r = 0; r < R; ++r) all_stopped = all_stopped && sampler.stopped(r);
    }
    if (step == 0) {
      g.prefill_seconds = clock.seconds();
      clock.restart();
    }
    if (all_stopped) break;
  }
  g.decode_seconds = clock.seconds();
  g.tokens = sampler.take_tokens();
  for (const auto& t : g.tokens) g.decoded_tokens += int64_t(t.size()) - 1;
  return g;
}

Result<std::vector<std::vector<float>>> next_token_logits(
    Transformer& model, const std::vector<std::vector<int64_t>>& prompts, Precision precision) {
  WL_RETURN_IF_ERROR(check_prompts(model.config(), prompts, 0));
  KvCache cache(model.config(), int64_t(prompts.size()));
  std::vector<float> logits = forward_cached(model, cache, prompts, precision, nullptr);
  std::vector<std::vector<float>> out;
  const size_t V = size_t(model.config().vocab_size);
  for (size_t r = 0; r < prompts.size(); ++r)
    out.emplace_back(logits.begin() + long(r * V), logits.begin() + long((r + 1) * V));
  return out;
}

}  // namespace wl::model
