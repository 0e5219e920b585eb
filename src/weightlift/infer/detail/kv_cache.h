// The inference worker's KV cache (worker.cc, batching.cc): this rank's keys and values (after
// RoPE), f32, in pages.
//
// KvPages is the worker's pool: pages of `page_tokens` positions, each holding those
// positions' keys and values for every layer ([layers][k, v][page_tokens, width]). It lives as
// long as the worker and only grows, a block of pages at a time, when a generation needs more
// pages than are free: a page is never moved or freed, so a run of generations of one shape
// allocates in its first and never after, and a page's address stays valid while it is held.
//
// KvCache is one generation's view of the pool, page tables over it:
//   entries  a prompt's keys and values, held once for every row of it that runs (a GRPO
//            group's G rows);
//   slots    each slot's own tokens, those its row fed after its prompt.
// A slot reads its prompt's entry, then its own pages: one attention over both page lists
// (kernels::attention_forward_paged). A slot whose entry holds nothing yet prefills it.
// Pages are taken as a row's tokens reach them (reserve) and go back to the pool when its
// entry or slot is cleared, and all of them when the generation ends.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/infer/worker.h"
#include "weightlift/kernels/attention.h"

namespace wl::infer {

class InferenceWorker::KvPages {
 public:
  KvPages(int64_t layers, int64_t page_tokens, int64_t width)
      : layers_(layers), page_tokens_(page_tokens), width_(width) {
    WL_CHECK(layers > 0 && page_tokens > 0 && width > 0);
  }
  int64_t page_tokens() const { return page_tokens_; }
  int64_t width() const { return width_; }
  // Floats of one page's keys (or values) of one layer.
  int64_t plane() const { return page_tokens_ * width_; }
  double page_bytes() const { return double(2 * layers_ * plane()) * 4.0; }
  int64_t pages() const { return int64_t(blocks_.size()) * kBlockPages; }  // the pool's

  int32_t take() {
    if (free_.empty()) grow();
    const int32_t p = free_.back();
    free_.pop_back();
    return p;
  }
  void give_back(int32_t page) { free_.push_back(page); }

  float* keys(int32_t page, size_t layer) { return at(page, layer, 0); }
  float* values(int32_t page, size_t layer) { return at(page, layer, 1); }

 private:
  static constexpr int64_t kBlockPages = 16;  // pages allocated together when the pool grows

  float* at(int32_t page, size_t layer, int64_t kv) {
    const int64_t in_block = page % kBlockPages;
    return blocks_[size_t(page / kBlockPages)].get() +
           ((in_block * layers_ + int64_t(layer)) * 2 + kv) * plane();
  }
  void grow() {
    blocks_.emplace_back(new float[size_t(kBlockPages * layers_ * 2 * plane())]);
    const int64_t first = pages() - kBlockPages;
    // Taken lowest first, so a run's pages lie in allocation order.
    for (int64_t p = pages() - 1; p >= first; --p) free_.push_back(int32_t(p));
  }

  const int64_t layers_, page_tokens_, width_;
  std::vector<std::unique_ptr<float[]>> blocks_;
  std::vector<int32_t> free_;
};

struct InferenceWorker::KvCache {
  KvPages& pool;
  std::vector<std::vector<int32_t>> prompt_pages;  // per entry
  std::vector<std::vector<int32_t>> pages;         // per slot: its own tokens'
  std::vector<int64_t> prompt_length;              // per entry: its prompt's tokens, once prefilled
  std::vector<int64_t> length;                     // per slot: its own tokens (after the prompt)
  std::vector<int64_t> entry;                      // per slot: the entry of its prompt
  int64_t peak_pages = 0;                          // the most pages held at once

  KvCache(KvPages& pool_, int64_t entries, int64_t slots)
      : pool(pool_),
        prompt_pages(size_t(entries)),
        pages(size_t(slots)),
        prompt_length(size_t(entries), 0),
        length(size_t(slots), 0),
        entry(size_t(slots), 0) {}
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  ~KvCache() {
    for (auto& p : prompt_pages) give_back(p);
    for (auto& p : pages) give_back(p);
  }
  // Slot s feeds n tokens next: into its entry when that holds nothing yet (a prefill), else
  // after its own. Takes the pages they reach.
  void reserve(size_t s, int64_t n) {
    const size_t e = size_t(entry[s]);
    if (prompt_length[e] == 0) {
      cover(prompt_pages[e], n);
    } else {
      cover(pages[s], length[s] + n);
    }
  }
  void clear_entry(size_t e) {
    give_back(prompt_pages[e]);
    prompt_length[e] = 0;
  }
  void clear_slot(size_t s) {
    give_back(pages[s]);
    length[s] = 0;
  }
  double peak_bytes() const { return double(peak_pages) * pool.page_bytes(); }

  // The first `tokens` positions of a page list, as attention segments of layer l.
  void segments(const std::vector<int32_t>& list, int64_t tokens, size_t l,
                std::vector<kernels::KvSegment>& out) const {
    for (size_t i = 0; tokens > 0; ++i) {
      const int64_t n = std::min(tokens, pool.page_tokens());
      out.push_back({pool.keys(list[i], l), pool.values(list[i], l), n});
      tokens -= n;
    }
  }
  // Position t of a page list in layer l: where its key (value) row is.
  float* key_row(const std::vector<int32_t>& list, int64_t t, size_t l) const {
    return pool.keys(list[size_t(t / pool.page_tokens())], l) +
           t % pool.page_tokens() * pool.width();
  }
  float* value_row(const std::vector<int32_t>& list, int64_t t, size_t l) const {
    return pool.values(list[size_t(t / pool.page_tokens())], l) +
           t % pool.page_tokens() * pool.width();
  }

 private:
  int64_t held_ = 0;
  void cover(std::vector<int32_t>& list, int64_t tokens) {
    while (int64_t(list.size()) * pool.page_tokens() < tokens) {
      list.push_back(pool.take());
      peak_pages = std::max(peak_pages, ++held_);
    }
  }
  void give_back(std::vector<int32_t>& list) {
    for (int32_t p : list) pool.give_back(p);
    held_ -= int64_t(list.size());
    list.clear();
  }
};

}  // namespace wl::infer
