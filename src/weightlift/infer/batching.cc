// InferenceWorker::generate (worker.h): continuous batching over a fixed set of slots.
//
// The rows of a generation wait in order. Every step, each free slot takes the next waiting
// row; one forward runs every slot's new tokens (the whole prompt of a row just admitted, one
// token of the others); each running row samples its next token; a row that stops (its stop
// token, a stop sequence, its length) frees its slot, and its KV pages, for the next step's
// admission.
//
// A prompt that several rows hold (a GRPO group's G samples) is prefilled once into an entry
// of the KV cache (detail/kv_cache.h) that every running row of it reads: a row admitted
// while the entry is held (a row of the prompt running, or prefilling it this step) takes the
// prefill's logits and routes, kept while rows of the prompt wait, and writes only its own
// tokens. When no running row reads the entry any more it and its pages are freed, and the
// next row of the prompt prefills it again.
#include <algorithm>
#include <cstring>
#include <map>

#include "weightlift/core/parallel.h"
#include "weightlift/core/timing.h"
#include "weightlift/infer/dequant_linear.h"
#include "weightlift/infer/detail/kv_cache.h"
#include "weightlift/infer/worker.h"
#include "weightlift/model/generate.h"

namespace wl::infer {
namespace {

constexpr size_t kFree = SIZE_MAX;  // a slot without a row; a prompt no slot holds

int64_t max_new_of(const GenerateOptions& o, size_t row) {
  return o.max_new_per_row.empty() ? o.max_new_tokens : o.max_new_per_row[row];
}

bool ends_with_one_of(const std::vector<int64_t>& tokens,
                      const std::vector<std::vector<int64_t>>& sequences) {
  return std::any_of(sequences.begin(), sequences.end(), [&](const std::vector<int64_t>& s) {
    return tokens.size() >= s.size() && std::equal(s.rbegin(), s.rend(), tokens.rbegin());
  });
}

// leader[r]: the first row holding row r's prompt (r itself when none before it does, or
// when nothing is shared). A prompt is known by its leader.
std::vector<size_t> prompt_leaders(const std::vector<std::vector<int64_t>>& rows, bool share) {
  std::vector<size_t> leader(rows.size());
  std::map<std::vector<int64_t>, size_t> first;
  for (size_t r = 0; r < rows.size(); ++r) {
    leader[r] = share ? first.try_emplace(rows[r], r).first->second : r;
  }
  return leader;
}

}  // namespace

// One rank's rows over the slots: which row each slot holds, which rows wait, and for each
// prompt a slot holding it and its prefill's logits and routes while rows of it wait.
class InferenceWorker::Batch {
 public:
  // rows: this rank's, the first of them row `first_row` of the request.
  Batch(InferenceWorker& worker, const BoundWeights& w,
        const std::vector<std::vector<int64_t>>& rows, size_t first_row, uint64_t seed,
        const GenerateOptions& o)
      : wk_(worker),
        w_(w),
        rows_(rows),
        o_(o),
        first_row_(first_row),
        V_(size_t(worker.options_.config.vocab_size)),
        per_token_(size_t(worker.options_.config.num_layers * worker.options_.config.top_k)),
        leader_(prompt_leaders(rows, o.share_prompts)),
        cache_(*worker.kv_pages_, entry_count(leader_, o), int64_t(slot_count(rows.size(), o))),
        sampler_(rows.size(), o.sampling, seed, o.stop_token),
        waiting_(rows.size(), 0),
        entry_of_(rows.size(), kFree),
        held_logits_(rows.size()),
        held_routes_(rows.size()),
        refs_(cache_.prompt_length.size(), 0),
        slot_row_(cache_.length.size(), kFree),
        prefilling_(slot_row_.size(), 0),
        copying_(slot_row_.size(), 0),
        feed_(slot_row_.size()) {
    for (size_t r = 0; r < rows.size(); ++r) ++waiting_[leader_[r]];
    for (size_t e = refs_.size(); e > 0; --e) free_entries_.push_back(e - 1);
    if (o.keep_logits) g_.logits.assign(rows.size(), {});
    if (o.keep_routes) g_.routes.assign(rows.size(), {});
  }

  bool busy() const { return next_ < rows_.size() || live_ > 0; }

  // Admits waiting rows into free slots, runs one forward over every slot's new tokens, hands
  // the prefilled prompts to the rows that copy them, and samples every running row.
  Status step() {
    admit();
    WL_ASSIGN_OR_RETURN(Tensor logits,
                        wk_.forward(w_, cache_, feed_, false, o_.keep_routes ? &routes_ : nullptr));
    keep_routes();
    share(logits.data<float>());
    sample(logits.data<float>());
    return ok_status();
  }

  Generation take() {
    g_.kv_cache_bytes = cache_.peak_bytes();
    g_.kv_pool_bytes = double(cache_.pool.pages()) * cache_.pool.page_bytes();
    g_.tokens = sampler_.take_tokens();
    g_.logprobs = sampler_.take_logprobs();
    return std::move(g_);
  }

 private:
  static size_t slot_count(size_t rows, const GenerateOptions& o) {
    return o.slots > 0 ? std::min(rows, size_t(o.slots)) : rows;
  }
  // Prompts held at once: one per running row at most, one per distinct prompt at most.
  static int64_t entry_count(const std::vector<size_t>& leader, const GenerateOptions& o) {
    size_t distinct = 0;
    for (size_t r = 0; r < leader.size(); ++r) distinct += leader[r] == r;
    return int64_t(std::min(distinct, slot_count(leader.size(), o)));
  }
  void admit() {
    std::fill(prefilling_.begin(), prefilling_.end(), 0);
    std::fill(copying_.begin(), copying_.end(), 0);
    for (size_t s = 0; s < slot_row_.size() && next_ < rows_.size(); ++s) {
      if (slot_row_[s] != kFree) continue;
      const size_t r = next_++, p = leader_[r];
      slot_row_[s] = r;
      ++live_;
      --waiting_[p];
      if (entry_of_[p] != kFree) {
        copying_[s] = 1;  // its logits and routes after the forward
      } else {
        prefilling_[s] = 1;
        entry_of_[p] = free_entries_.back();
        free_entries_.pop_back();
        feed_[s] = rows_[r];
        g_.prefill_tokens += int64_t(rows_[r].size());
      }
      cache_.entry[s] = int64_t(entry_of_[p]);
      ++refs_[entry_of_[p]];
    }
  }

  // Each fed token's experts, appended to its row's routes.
  void keep_routes() {
    if (!o_.keep_routes) return;
    size_t at = 0;
    for (size_t s = 0; s < feed_.size(); ++s) {
      const size_t n = feed_[s].size() * per_token_;
      if (n == 0) continue;
      std::vector<int32_t>& to = g_.routes[slot_row_[s]];
      to.insert(to.end(), routes_.begin() + int64_t(at), routes_.begin() + int64_t(at + n));
      at += n;
    }
  }

  // Prefills' logits and routes are kept while rows of their prompt wait; rows admitted to
  // share a prompt take them.
  void share(float* logits) {
    for (size_t s = 0; s < slot_row_.size(); ++s) {
      if (!prefilling_[s]) continue;
      const size_t r = slot_row_[s], p = leader_[r];
      held_logits_[p].assign(logits + s * V_, logits + (s + 1) * V_);
      if (o_.keep_routes) held_routes_[p] = g_.routes[r];
    }
    for (size_t s = 0; s < slot_row_.size(); ++s) {
      if (!copying_[s]) continue;
      const size_t r = slot_row_[s], p = leader_[r];
      std::memcpy(logits + s * V_, held_logits_[p].data(), V_ * 4);
      if (o_.keep_routes) g_.routes[r] = held_routes_[p];
    }
    for (size_t p = 0; p < rows_.size(); ++p) {
      if (waiting_[p] == 0 && !held_logits_[p].empty()) {
        held_logits_[p] = {};
        held_routes_[p] = {};
      }
    }
  }

  void sample(const float* logits) {
    std::vector<uint8_t> done(slot_row_.size(), 0);
    parallel_for(int64_t(slot_row_.size()), model::sampling_grain(int64_t(V_)),
                 [&](int64_t s0, int64_t s1) {
                   for (size_t s = size_t(s0); s < size_t(s1); ++s) {
                     feed_[s].clear();
                     if (slot_row_[s] == kFree) continue;
                     done[s] = pick(s, logits + s * V_);
                   }
                 });
    for (size_t s = 0; s < slot_row_.size(); ++s) {
      if (!done[s] && slot_row_[s] != kFree && o_.stop_when &&
          o_.stop_when(first_row_ + slot_row_[s], sampler_.tokens()[slot_row_[s]])) {
        done[s] = 1;
        feed_[s].clear();
      }
      if (done[s]) release(s);
    }
  }

  // Slot s's row picks its next token; true when the row stops there.
  bool pick(size_t s, const float* logits) {
    const size_t r = slot_row_[s];
    if (o_.keep_logits) g_.logits[r].emplace_back(logits, logits + V_);
    if (sampler_.pick(r, logits, int64_t(V_))) return true;
    const std::vector<int64_t>& tokens = sampler_.tokens()[r];
    if (int64_t(tokens.size()) >= max_new_of(o_, r)) return true;
    if (ends_with_one_of(tokens, o_.stop_sequences)) return true;
    feed_[s].push_back(tokens.back());
    return false;
  }

  // The slot's row is done: the slot and its pages are free, and so are its prompt's entry
  // and pages once no running row reads it (a row of that prompt admitted later prefills it
  // again).
  void release(size_t s) {
    const size_t p = leader_[slot_row_[s]], e = size_t(cache_.entry[s]);
    slot_row_[s] = kFree;
    --live_;
    cache_.clear_slot(s);
    if (--refs_[e] > 0) return;
    entry_of_[p] = kFree;
    cache_.clear_entry(e);
    free_entries_.push_back(e);
  }

  InferenceWorker& wk_;
  const BoundWeights& w_;
  const std::vector<std::vector<int64_t>>& rows_;
  const GenerateOptions& o_;
  const size_t first_row_;
  const size_t V_, per_token_;  // vocabulary; route entries per token
  std::vector<size_t> leader_;  // per row: its prompt's leader (a prompt is known by it)
  KvCache cache_;
  model::RowSampler sampler_;
  // Per prompt: its rows not yet admitted, the cache entry holding it (or kFree), its
  // prefill's logits and routes while rows of it wait.
  std::vector<size_t> waiting_, entry_of_;
  std::vector<std::vector<float>> held_logits_;
  std::vector<std::vector<int32_t>> held_routes_;
  // Per cache entry: the running rows that read it. The entries no prompt holds.
  std::vector<size_t> refs_, free_entries_;
  // Per slot: its row (or kFree), whether it was admitted this step to prefill or to copy,
  // what it feeds this step.
  std::vector<size_t> slot_row_;
  std::vector<uint8_t> prefilling_, copying_;
  std::vector<std::vector<int64_t>> feed_;
  std::vector<int32_t> routes_;  // the last forward's, [fed tokens][layers][top_k]
  size_t next_ = 0, live_ = 0;   // the next waiting row; rows in slots
  Generation g_;
};

Status InferenceWorker::check_options(const std::vector<std::vector<int64_t>>& prompts,
                                      const GenerateOptions& o) const {
  const std::string who = "inference worker: ";
  if (o.max_new_tokens < 1) {
    return invalid_argument(who + "max_new_tokens is " + std::to_string(o.max_new_tokens) +
                            ", must be >= 1");
  }
  if (o.slots < 0) {
    return invalid_argument(who + "slots is " + std::to_string(o.slots) +
                            ", must be >= 1 (or 0: every row at once)");
  }
  if (!o.max_new_per_row.empty() && o.max_new_per_row.size() != prompts.size()) {
    return invalid_argument(who + "max_new_per_row has " +
                            std::to_string(o.max_new_per_row.size()) + " entries for " +
                            std::to_string(prompts.size()) + " prompts");
  }
  std::vector<int64_t> most(prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    most[r] = max_new_of(o, r);
    if (most[r] < 1 || most[r] > o.max_new_tokens) {
      return invalid_argument(who + "max_new_per_row[" + std::to_string(r) + "] is " +
                              std::to_string(most[r]) + ", outside [1, max_new_tokens " +
                              std::to_string(o.max_new_tokens) + "]");
    }
  }
  for (size_t i = 0; i < o.stop_sequences.size(); ++i) {
    const std::vector<int64_t>& s = o.stop_sequences[i];
    const bool in_vocab = std::all_of(
        s.begin(), s.end(), [&](int64_t t) { return t >= 0 && t < options_.config.vocab_size; });
    if (s.empty() || !in_vocab) {
      return invalid_argument(who + "stop sequence " + std::to_string(i) +
                              (s.empty() ? " is empty" : " holds a token outside the vocabulary"));
    }
  }
  return check_prompts(prompts, most);
}

Result<Generation> InferenceWorker::generate(const BoundWeights& w,
                                             const std::vector<std::vector<int64_t>>& prompts,
                                             const GenerateOptions& o) {
  WL_RETURN_IF_ERROR(check_options(prompts, o));
  // This rank's rows: all of them, or under EP its share [lo, hi).
  const int ep = options_.layout.ep, ep_rank = options_.layout.ep_rank;
  const size_t lo = prompts.size() * size_t(ep_rank) / size_t(ep);
  const size_t hi = prompts.size() * size_t(ep_rank + 1) / size_t(ep);
  const std::vector<std::vector<int64_t>> rows(prompts.begin() + int64_t(lo),
                                               prompts.begin() + int64_t(hi));
  GenerateOptions mine = o;
  if (!o.max_new_per_row.empty()) {
    mine.max_new_per_row.assign(o.max_new_per_row.begin() + int64_t(lo),
                                o.max_new_per_row.begin() + int64_t(hi));
  }
  std::vector<AlignedVector<float>> widened;  // the f32 copy, while the generation runs
  const BoundWeights wide = options_.widen_per_generation
                                ? widen_weights(w, options_.bf16_activations, widened)
                                : BoundWeights{};
  Batch batch(*this, options_.widen_per_generation ? wide : w, rows, lo, o.seed + lo, mine);
  Stopwatch clock;  // the first step (the first slots' prefill), then the others
  double prefill_seconds = 0;
  for (int64_t step = 0;; ++step) {
    bool running = batch.busy();
    if (ep > 1) {  // the ranks step together while any row runs or waits anywhere
      WL_ASSIGN_OR_RETURN(running, any_running(running));
    }
    if (!running) break;
    WL_RETURN_IF_ERROR(batch.step());
    if (step == 0) {
      prefill_seconds = clock.seconds();
      clock.restart();
    }
  }
  Generation g = batch.take();
  g.prefill_seconds = prefill_seconds;
  g.decode_seconds = clock.seconds();
  if (ep > 1 && options_.layout.tp_rank == 0) {
    WL_RETURN_IF_ERROR(collect_rows(g, prompts.size(), o.keep_logits, o.keep_routes));
  } else if (ep > 1) {
    g = Generation{.version = g.version};  // TP rank 0 of EP rank 0 returns them
  }
  return g;
}

}  // namespace wl::infer
