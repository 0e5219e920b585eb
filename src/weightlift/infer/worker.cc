// The inference worker of worker.h: a KV-cached forward pass over one TP or EP rank's shard of
// the inference layout (two allreduces per block under TP, the experts' all-to-alls under EP),
// and the version agreement around a generation (the decoding loop is batching.cc's).
#include "weightlift/infer/worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "weightlift/comm/collectives/all_to_all.h"
#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/core/parallel.h"
#include "weightlift/core/timing.h"
#include "weightlift/infer/dequant_linear.h"
#include "weightlift/infer/detail/kv_cache.h"
#include "weightlift/kernels/attention.h"
#include "weightlift/kernels/rmsnorm.h"
#include "weightlift/kernels/router.h"
#include "weightlift/kernels/swiglu.h"
#include "weightlift/model/generate.h"

namespace wl::infer {

using Clock = std::chrono::steady_clock;

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

namespace {

// At a degree above 1, the engine's group of that kind (`kind`: "TP", `field`: "tp"), of that
// size, with this rank at the layout's rank.
Status check_group(const std::string& kind, const std::string& field, const comm::Group* group,
                   int degree, int rank) {
  if (degree == 1) return ok_status();
  if (group == nullptr) {
    return invalid_argument("inference worker: " + field + " " + std::to_string(degree) +
                            " needs " + (kind == "EP" ? "an " : "a ") + kind +
                            " group (WorkerOptions::" + field + "_group)");
  }
  if (group->size() != degree || group->rank() != rank) {
    return invalid_argument("inference worker: the " + kind + " group is rank " +
                            std::to_string(group->rank()) + " of " + std::to_string(group->size()) +
                            ", the layout says " + field + " rank " + std::to_string(rank) +
                            " of " + std::to_string(degree));
  }
  return ok_status();
}

}  // namespace

Result<std::unique_ptr<InferenceWorker>> InferenceWorker::create(WorkerOptions o) {
  WL_RETURN_IF_ERROR(o.config.validate("inference worker: config"));
  WL_RETURN_IF_ERROR(transfer::inference_layout(o.config, o.layout).status());
  WL_RETURN_IF_ERROR(check_group("TP", "tp", o.tp_group.get(), o.layout.tp, o.layout.tp_rank));
  WL_RETURN_IF_ERROR(check_group("EP", "ep", o.ep_group.get(), o.layout.ep, o.layout.ep_rank));
  if (o.kv_page_tokens < 1) {
    return invalid_argument("inference worker: kv_page_tokens is " +
                            std::to_string(o.kv_page_tokens) + ", must be >= 1");
  }
  const int tp = o.layout.tp;
  std::unique_ptr<InferenceWorker> w(new InferenceWorker(std::move(o)));
  const model::ModelConfig& c = w->options_.config;
  w->rope_ = model::make_rope_table(c);
  w->local_heads_ = c.num_heads / tp;
  w->local_kv_heads_ = c.num_kv_heads >= tp ? c.num_kv_heads / tp : 1;
  w->local_ffn_ = c.ffn_dim / tp;
  w->kv_pages_ = std::make_unique<KvPages>(c.num_layers, w->options_.kv_page_tokens,
                                           w->local_kv_heads_ * c.head_dim);
  return w;
}

bool InferenceWorker::one_rank() const {
  return options_.layout.tp == 1 && options_.layout.ep == 1;
}

// Over the TP group, then the EP group: the first max gives every rank its EP rank's max (the
// TP ranks of one EP rank), the second combines the EP ranks'.
Status InferenceWorker::engine_max(int64_t* values, size_t count) {
  for (const std::shared_ptr<comm::Group>& g : {options_.tp_group, options_.ep_group}) {
    if (!g || g->size() == 1) continue;
    WL_RETURN_IF_ERROR(comm::allreduce(*g, {.recv = values,
                                            .count = count,
                                            .dtype = DType::kI64,
                                            .op = comm::ReduceOp::kMax,
                                            .timeout = options_.timeout}));
  }
  return ok_status();
}

std::string InferenceWorker::who() const {
  return "inference worker (" + transfer::describe_rank(options_.layout) + ")";
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
  return s.with_context(who());
}

// The TP ranks of an EP rank hold the same rows and pick the same tokens: its EP group asks
// for all of them.
Result<bool> InferenceWorker::any_running(bool mine) {
  int64_t running = mine ? 1 : 0;
  Status s = comm::allreduce(*options_.ep_group, {.recv = &running,
                                                  .count = 1,
                                                  .dtype = DType::kI64,
                                                  .op = comm::ReduceOp::kMax,
                                                  .timeout = options_.timeout});
  if (!s.ok()) return s.with_context(who() + ": asking whether a row still runs");
  return running != 0;
}

Status InferenceWorker::check_prompts(const std::vector<std::vector<int64_t>>& prompts,
                                      const std::vector<int64_t>& new_tokens) const {
  const model::ModelConfig& c = options_.config;
  if (prompts.empty()) return invalid_argument("inference worker: no prompts");
  for (size_t r = 0; r < prompts.size(); ++r) {
    const std::string row = "inference worker: prompt " + std::to_string(r);
    if (prompts[r].empty()) return invalid_argument(row + " is empty");
    if (int64_t(prompts[r].size()) + new_tokens[r] > c.max_seq_len) {
      return invalid_argument(row + " has " + std::to_string(prompts[r].size()) + " tokens; with " +
                              std::to_string(new_tokens[r]) +
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
  void attend_row(const BoundLayer& lw, size_t l, int64_t r);
  Status o_proj(const BoundLayer& lw);
  // keep, when not null: the tokens whose output is read (the others' experts do not run).
  Status moe(const BoundLayer& lw, size_t l, const uint8_t* keep);
  Status dense_mlp(const BoundLayer& lw);
  // Rows grouped by expert, token order within one, as the trainer dispatches them (the kept
  // tokens' slots only, when `keep`; each expert's capacity over this pass's tokens, with the
  // model's capacity factor); `dropped` [M, K] (may be null) marks the slots dropped over
  // capacity. Returns the rows.
  int64_t dispatch(const uint8_t* keep, std::vector<int64_t>& begin,
                   std::vector<int32_t>& row_of_slot, std::vector<int32_t>& token_of_row,
                   uint8_t* dropped);
  Status add_partial();  // tp > 1: allreduce the partial sums, add them into x
  // The experts this rank holds over rows grouped by local expert (begin: [local experts + 1]
  // offsets): y = down(silu(gate) * up) of each row.
  void run_experts(const BoundLayer& lw, const std::vector<int64_t>& begin, const float* x,
                   float* y);
  // ep > 1: rows grouped by (global) expert go to their experts' ranks, which run them with
  // every other rank's, and come back in the same order.
  Status experts_of_ranks(const BoundLayer& lw, const std::vector<int64_t>& begin, const Tensor& xe,
                          Tensor& ye);

  InferenceWorker& wk_;
  const model::ModelConfig& c_;
  const BoundWeights& w_;
  KvCache& cache_;
  const int64_t d_, E_, K_, H_, Hkv_, F_, qd_, kvd_, qkvd_;
  const float eps_;
  const bool tp_, ep_;
  std::vector<int64_t> tokens_, row_begin_;  // concatenated new tokens; first index of each row
  int64_t M_ = 0, R_ = 0;
  std::vector<int32_t>* routes_;
  const bool bf16_;  // WorkerOptions::bf16_activations
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
      ep_(worker.options_.layout.ep > 1),
      routes_(routes),
      bf16_(worker.options_.bf16_activations) {
  for (const auto& f : feed) {
    row_begin_.push_back(int64_t(tokens_.size()));
    tokens_.insert(tokens_.end(), f.begin(), f.end());
  }
  row_begin_.push_back(int64_t(tokens_.size()));
  M_ = int64_t(tokens_.size());
  R_ = int64_t(feed.size());
  for (size_t r = 0; r < feed.size(); ++r) {
    if (!feed[r].empty()) cache_.reserve(r, int64_t(feed[r].size()));
  }
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

// Local heads against this rank's cache, row by row (attend_row). A row of many new tokens
// (a prefill) spreads its attention over the compute threads; the rows of one token each (a
// decode step's) hold one tile per kv head, so they run side by side, a row per thread.
void InferenceWorker::ForwardPass::attention(const BoundLayer& lw, size_t l) {
  widen(lw.attn_norm, d_, gain_);
  kernels::rmsnorm_forward(x_.data<float>(), gain_.data(), xn_.data<float>(), nullptr, M_, d_,
                           eps_);
  dequant_linear(lw.qkv, xn_.data<float>(), M_, qkv_.data<float>(), false, wk_.band_, bf16_);
  if (lw.q_norm) {
    widen(lw.q_norm, c_.head_dim, q_gain_);
    widen(lw.k_norm, c_.head_dim, k_gain_);
  }
  std::vector<int64_t> single;  // rows feeding one token
  for (int64_t r = 0; r < R_; ++r) {
    const int64_t n = row_begin_[size_t(r) + 1] - row_begin_[size_t(r)];
    if (n == 1) {
      single.push_back(r);
    } else if (n > 1) {
      attend_row(lw, l, r);
    }
  }
  parallel_for_each(int64_t(single.size()),
                    [&](int64_t i) { attend_row(lw, l, single[size_t(i)]); });
}

// Row r's q, k and v of its new tokens; k and v appended (to its prompt's entry when it
// prefills it, else to its own pages), then one attention over the prompt's pages and its own
// (its new tokens included). Writes only row r's pages and output rows.
void InferenceWorker::ForwardPass::attend_row(const BoundLayer& lw, size_t l, int64_t r) {
  const int64_t Dh = c_.head_dim;
  const int64_t n = row_begin_[size_t(r) + 1] - row_begin_[size_t(r)];
  const size_t e = size_t(cache_.entry[size_t(r)]);
  const int64_t prompt = cache_.prompt_length[e];
  const bool prefill = prompt == 0;
  // Where the new keys go, and their first position in the sequence.
  const std::vector<int32_t>& list = prefill ? cache_.prompt_pages[e] : cache_.pages[size_t(r)];
  const int64_t at = prefill ? 0 : cache_.length[size_t(r)], pos = prefill ? 0 : prompt + at;
  Tensor q = f32({n, qd_}), k = f32({n, kvd_});
  for (int64_t t = 0; t < n; ++t) {
    const float* src = qkv_.data<float>() + (row_begin_[size_t(r)] + t) * qkvd_;
    std::memcpy(q.data<float>() + t * qd_, src, size_t(qd_) * 4);
    std::memcpy(k.data<float>() + t * kvd_, src + qd_, size_t(kvd_) * 4);
    std::memcpy(cache_.value_row(list, at + t, l), src + qd_ + kvd_, size_t(kvd_) * 4);
  }
  if (lw.q_norm) {  // Qwen3's per-head norms, before RoPE (the cache holds normed keys)
    kernels::rmsnorm_forward(q.data<float>(), q_gain_.data(), q.data<float>(), nullptr, n * H_, Dh,
                             eps_);
    kernels::rmsnorm_forward(k.data<float>(), k_gain_.data(), k.data<float>(), nullptr, n * Hkv_,
                             Dh, eps_);
  }
  kernels::rope_forward(q.data<float>(), wk_.rope_, 1, n, H_, pos);
  kernels::rope_forward(k.data<float>(), wk_.rope_, 1, n, Hkv_, pos);
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(cache_.key_row(list, at + t, l), k.data<float>() + t * kvd_, size_t(kvd_) * 4);
  }
  std::vector<kernels::KvSegment> segments;
  if (!prefill) cache_.segments(cache_.prompt_pages[e], prompt, l, segments);
  cache_.segments(list, at + n, l, segments);
  const int64_t seen = pos + n;
  kernels::attention_forward_paged({.batch = 1,
                                    .seq_q = n,
                                    .seq_kv = seen,
                                    .heads = H_,
                                    .kv_heads = Hkv_,
                                    .head_dim = Dh,
                                    .q_offset = seen - n},
                                   q.data<float>(), segments,
                                   att_.data<float>() + row_begin_[size_t(r)] * qd_, nullptr);
}

Status InferenceWorker::ForwardPass::add_partial() {
  WL_RETURN_IF_ERROR(wk_.allreduce_sum(partial_.data<float>(), size_t(M_ * d_)));
  add_into(x_.data<float>(), partial_.data<float>(), M_ * d_);
  return ok_status();
}

// Row parallel: at tp > 1 each rank's partial sums, then the allreduce.
Status InferenceWorker::ForwardPass::o_proj(const BoundLayer& lw) {
  if (!tp_) {
    dequant_linear(lw.o, att_.data<float>(), M_, x_.data<float>(), true, wk_.band_, bf16_);
    return ok_status();
  }
  dequant_linear(lw.o, att_.data<float>(), M_, partial_.data<float>(), false, wk_.band_, bf16_);
  return add_partial();
}

int64_t InferenceWorker::ForwardPass::dispatch(const uint8_t* keep, std::vector<int64_t>& begin,
                                               std::vector<int32_t>& row_of_slot,
                                               std::vector<int32_t>& token_of_row,
                                               uint8_t* dropped) {
  begin.assign(size_t(E_ + 1), 0);
  row_of_slot.resize(size_t(M_ * K_));
  token_of_row.resize(size_t(M_ * K_));
  // The model's capacity over this pass's tokens, as a training pass over them would drop.
  const double factor = c_.capacity_factor.value_or(0.0);
  const kernels::RouterShape rs{
      .tokens = M_,
      .experts = E_,
      .top_k = K_,
      .capacity = factor > 0 ? kernels::expert_capacity(factor, M_, K_, E_) : 0};
  return kernels::group_by_expert(rs, topk_idx_.data<int32_t>(), keep, begin.data(),
                                  row_of_slot.data(), token_of_row.data(), nullptr,
                                  {.marks = dropped});
}

// A dense layer's MLP over every token (xn_ already normed): this rank's Fd/tp rows.
Status InferenceWorker::ForwardPass::dense_mlp(const BoundLayer& lw) {
  const int64_t f = lw.mlp.down.cols;
  Tensor he = f32({M_, 2 * f}), ae = f32({M_, f});
  dequant_linear(lw.mlp.gate_up, xn_.data<float>(), M_, he.data<float>(), false, wk_.band_, bf16_);
  kernels::swiglu_forward(he.data<float>(), ae.data<float>(), M_, f);
  if (!tp_) {
    dequant_linear(lw.mlp.down, ae.data<float>(), M_, x_.data<float>(), true, wk_.band_, bf16_);
    return ok_status();
  }
  dequant_linear(lw.mlp.down, ae.data<float>(), M_, partial_.data<float>(), false, wk_.band_,
                 bf16_);
  return add_partial();
}

void InferenceWorker::ForwardPass::run_experts(const BoundLayer& lw,
                                               const std::vector<int64_t>& begin, const float* x,
                                               float* y) {
  const int64_t S = begin.back();
  Tensor he = f32({S, 2 * F_}), ae = f32({S, F_});
  std::vector<size_t> busy;  // the experts with rows, most rows first
  for (size_t e = 0; e + 1 < begin.size(); ++e) {
    if (begin[e + 1] > begin[e]) busy.push_back(e);
  }
  std::stable_sort(busy.begin(), busy.end(), [&](size_t a, size_t b) {
    return begin[a + 1] - begin[a] > begin[b + 1] - begin[b];
  });
  auto run = [&](size_t e, AlignedVector<float>& band) {
    const int64_t r0 = begin[e], n = begin[e + 1] - r0;
    const BoundExpert& ex = lw.experts[e];
    dequant_linear(ex.gate_up, x + r0 * d_, n, he.data<float>() + r0 * 2 * F_, false, band, bf16_);
    kernels::swiglu_forward(he.data<float>() + r0 * 2 * F_, ae.data<float>() + r0 * F_, n, F_);
    dequant_linear(ex.down, ae.data<float>() + r0 * F_, n, y + r0 * d_, false, band, bf16_);
  };
  if (busy.size() < size_t(num_threads())) {  // fewer experts than threads: each shares its GEMMs
    for (size_t e : busy) run(e, wk_.band_);
    return;
  }
  // One expert per task, its GEMMs inline on the task's thread. A decode step's few rows per
  // expert make GEMMs too small to share, and widening the expert's bf16 or fp8 weights is most
  // of its work: one expert at a time, that was one thread working while the others waited
  // (bench generate 8 x 8 on 2 threads: 4.6k tokens/s before, 8.2k after). Each thread widens
  // into its own band, which it keeps for the next layer and step (at most 128 rows of the
  // widest matrix, like band_).
  parallel_for_each(int64_t(busy.size()), [&](int64_t i) {
    thread_local AlignedVector<float> band;
    run(busy[size_t(i)], band);
  });
}

// Counts first (rows per expert for each rank), then the rows; an expert's rows are regrouped
// in rank order before it runs, and go back the way they came.
Status InferenceWorker::ForwardPass::experts_of_ranks(const BoundLayer& lw,
                                                      const std::vector<int64_t>& begin,
                                                      const Tensor& xe, Tensor& ye) {
  comm::Group& g = *wk_.options_.ep_group;
  const int P = g.size();
  const int64_t El = E_ / P;
  const std::chrono::milliseconds timeout = wk_.options_.timeout;
  std::vector<int64_t> send_n(static_cast<size_t>(E_)), recv_n(static_cast<size_t>(E_));
  for (int64_t e = 0; e < E_; ++e) send_n[size_t(e)] = begin[size_t(e + 1)] - begin[size_t(e)];
  Status s = comm::all_to_all(g, {.send = send_n.data(),
                                  .recv = recv_n.data(),
                                  .count = size_t(El),
                                  .dtype = DType::kI64,
                                  .timeout = timeout});
  if (!s.ok()) return s.with_context(wk_.who() + ": exchanging expert counts");
  // Rows to and from each rank (elements of d floats), and where each (rank, local expert)
  // block of the received rows sits.
  const size_t ranks = static_cast<size_t>(P);
  std::vector<size_t> sc(ranks), so(ranks), rc(ranks), ro(ranks);
  std::vector<int64_t> block_at(static_cast<size_t>(E_));
  int64_t received = 0;
  for (int i = 0; i < P; ++i) {
    so[size_t(i)] = size_t(begin[size_t(i * El)] * d_);
    sc[size_t(i)] = size_t((begin[size_t((i + 1) * El)] - begin[size_t(i * El)]) * d_);
    ro[size_t(i)] = size_t(received * d_);
    for (int64_t le = 0; le < El; ++le) {
      block_at[size_t(i * El + le)] = received;
      received += recv_n[size_t(i * El + le)];
    }
    rc[size_t(i)] = size_t(received * d_) - ro[size_t(i)];
  }
  Tensor xr = f32({received, d_}), yr = f32({received, d_});
  s = comm::all_to_all_v(g, {.send = xe.raw(),
                             .recv = xr.raw(),
                             .send_counts = sc,
                             .send_offsets = so,
                             .recv_counts = rc,
                             .recv_offsets = ro,
                             .timeout = timeout});
  if (!s.ok()) return s.with_context(wk_.who() + ": sending tokens to their experts' ranks");
  // Grouped by local expert, rank order within one: the rows one process would run.
  std::vector<int64_t> grouped(static_cast<size_t>(El + 1), 0), at(static_cast<size_t>(E_));
  for (int64_t le = 0; le < El; ++le) {
    grouped[size_t(le + 1)] = grouped[size_t(le)];
    for (int i = 0; i < P; ++i) {
      at[size_t(i * El + le)] = grouped[size_t(le + 1)];
      grouped[size_t(le + 1)] += recv_n[size_t(i * El + le)];
    }
  }
  Tensor xg = f32({received, d_}), yg = f32({received, d_});
  auto move_blocks = [&](const float* from, float* to, bool to_grouped) {
    for (int64_t b = 0; b < E_; ++b) {
      const int64_t n = recv_n[size_t(b)];
      const int64_t src = to_grouped ? block_at[size_t(b)] : at[size_t(b)];
      const int64_t dst = to_grouped ? at[size_t(b)] : block_at[size_t(b)];
      std::memcpy(to + dst * d_, from + src * d_, size_t(n * d_) * 4);
    }
  };
  move_blocks(xr.data<float>(), xg.data<float>(), true);
  run_experts(lw, grouped, xg.data<float>(), yg.data<float>());
  move_blocks(yg.data<float>(), yr.data<float>(), false);
  s = comm::all_to_all_v(g, {.send = yr.raw(),
                             .recv = ye.raw(),
                             .send_counts = rc,
                             .send_offsets = ro,
                             .recv_counts = sc,
                             .recv_offsets = so,
                             .timeout = timeout});
  if (!s.ok()) return s.with_context(wk_.who() + ": taking tokens back from their experts' ranks");
  return ok_status();
}

// The replicated router, then this rank's ffn rows of every expert (under EP: its experts,
// over every rank's tokens), combined by gate weight; or a dense layer's MLP.
Status InferenceWorker::ForwardPass::moe(const BoundLayer& lw, size_t l, const uint8_t* keep) {
  widen(lw.moe_norm, d_, gain_);
  kernels::rmsnorm_forward(x_.data<float>(), gain_.data(), xn_.data<float>(), nullptr, M_, d_,
                           eps_);
  if (lw.dense()) return dense_mlp(lw);
  std::vector<int64_t> begin(size_t(E_ + 1), 0);
  std::vector<int32_t> row_of_slot, token_of_row;
  int64_t S = 0;
  if (M_ > 0) {  // an EP rank whose rows have all stopped still serves the others' tokens
    dequant_linear(lw.router, xn_.data<float>(), M_, logits_r_.data<float>(), false, wk_.band_);
    kernels::router_forward({.tokens = M_, .experts = E_, .top_k = K_, .norm_topk = c_.norm_topk},
                            logits_r_.data<float>(), probs_.data<float>(),
                            topk_idx_.data<int32_t>(), topk_w_.data<float>(), nullptr,
                            counts_.data<int64_t>());
    std::vector<uint8_t> dropped(routes_ ? size_t(M_ * K_) : 0);
    S = dispatch(keep, begin, row_of_slot, token_of_row, routes_ ? dropped.data() : nullptr);
    if (routes_) {  // with the slots dropped over capacity marked, for the trainer to replay
      const int32_t* idx = topk_idx_.data<int32_t>();
      const int64_t stride = c_.num_layers * K_;
      for (int64_t t = 0; t < M_; ++t) {
        for (int64_t k = 0; k < K_; ++k) {
          const int32_t e = idx[t * K_ + k];
          (*routes_)[size_t(t * stride + int64_t(l) * K_ + k)] =
              dropped[size_t(t * K_ + k)] ? kernels::dropped_route(e) : e;
        }
      }
    }
  }
  Tensor xe = f32({S, d_}), ye = f32({S, d_});
  for (int64_t s = 0; s < S; ++s) {
    std::memcpy(xe.data<float>() + s * d_, xn_.data<float>() + token_of_row[size_t(s)] * d_,
                size_t(d_) * 4);
  }
  if (ep_) {
    WL_RETURN_IF_ERROR(experts_of_ranks(lw, begin, xe, ye));
  } else {
    run_experts(lw, begin, xe.data<float>(), ye.data<float>());
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
    const int64_t n = row_begin_[size_t(r) + 1] - row_begin_[size_t(r)];
    int64_t& prompt = cache_.prompt_length[size_t(cache_.entry[size_t(r)])];
    (prompt == 0 ? prompt : cache_.length[size_t(r)]) += n;
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
  WL_RETURN_IF_ERROR(check_prompts(prompts, std::vector<int64_t>(prompts.size(), 0)));
  KvCache cache(*kv_pages_, int64_t(prompts.size()), int64_t(prompts.size()));
  for (size_t s = 0; s < prompts.size(); ++s) cache.entry[s] = int64_t(s);
  WL_ASSIGN_OR_RETURN(Tensor all, forward(w, cache, prompts, true));
  std::vector<Tensor> out;
  int64_t row = 0;
  for (const auto& p : prompts) {
    out.push_back(all.slice(0, row, row + int64_t(p.size())).clone());
    row += int64_t(p.size());
  }
  return out;
}

Result<Generation> InferenceWorker::generate(const transfer::Receiver& receiver,
                                             const std::vector<std::vector<int64_t>>& prompts,
                                             const GenerateOptions& o) {
  const comm::Group* any = options_.tp_group ? options_.tp_group.get() : options_.ep_group.get();
  const std::chrono::milliseconds timeout = options_.timeout.count() > 0 ? options_.timeout
                                            : any != nullptr             ? any->default_timeout()
                                                             : std::chrono::milliseconds(0);
  const auto deadline = Clock::now() + timeout;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    transfer::Receiver::ReadGuard guard = receiver.acquire();
    Result<BoundWeights> w = bind(lookup_in(receiver, guard));
    if (!one_rank()) {
      // One max over the engine settles it for every rank alike: the highest and lowest
      // version held, whether some rank could not bind its weights, whether some rank is out
      // of time.
      const int64_t v = int64_t(guard.version());
      int64_t agree[4] = {v, -v, w.ok() ? 0 : 1, Clock::now() > deadline ? 1 : 0};
      Status s = engine_max(agree, 4);
      if (!s.ok()) {
        return s.with_context(who() + ": agreeing on a version");
      }
      if (!w.ok()) return w.status();
      if (agree[2] != 0) {
        return failed_precondition(who() +
                                   ": another rank of the engine could not bind its weights");
      }
      if (agree[0] != -agree[1]) {
        if (agree[3] != 0) {
          return deadline_exceeded(who() + ": the engine's ranks still hold weight versions " +
                                   std::to_string(-agree[1]) + " to " + std::to_string(agree[0]) +
                                   " after " + std::to_string(timeout.count()) + " ms");
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
