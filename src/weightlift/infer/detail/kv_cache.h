// The inference worker's KV cache (worker.cc, batching.cc): this rank's keys and values
// (after RoPE) for every layer, f32, allocated once for a generation, in two parts:
//   prompts  [layers][entries, prompt capacity, local kv heads * Dh]: a prompt's keys and
//            values, held once for every row of it that runs (a GRPO group's G rows);
//   rows     [layers][slots, row capacity, local kv heads * Dh]: each slot's own tokens, those
//            its row fed after its prompt.
// A slot reads its prompt's entry, then its own part: attention over the two, merged by their
// log-sum-exps (worker.cc). A slot whose entry holds nothing yet prefills it.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/core/tensor.h"
#include "weightlift/infer/worker.h"

namespace wl::infer {

struct InferenceWorker::KvCache {
  int64_t prompt_capacity = 0, row_capacity = 0, width = 0;
  std::vector<Tensor> prompt_k, prompt_v, k, v;
  std::vector<int64_t> prompt_length;  // per entry: its prompt's tokens, once prefilled
  std::vector<int64_t> length;         // per slot: its own tokens (after the prompt)
  std::vector<int64_t> entry;          // per slot: the entry of its prompt
  KvCache(int64_t layers, int64_t entries, int64_t prompt_capacity_, int64_t slots,
          int64_t row_capacity_, int64_t width_)
      : prompt_capacity(prompt_capacity_),
        row_capacity(row_capacity_),
        width(width_),
        prompt_length(size_t(entries), 0),
        length(size_t(slots), 0),
        entry(size_t(slots), 0) {
    for (int64_t l = 0; l < layers; ++l) {
      prompt_k.push_back(Tensor::empty(DType::kF32, {entries, prompt_capacity, width}));
      prompt_v.push_back(Tensor::empty(DType::kF32, {entries, prompt_capacity, width}));
      k.push_back(Tensor::empty(DType::kF32, {slots, row_capacity, width}));
      v.push_back(Tensor::empty(DType::kF32, {slots, row_capacity, width}));
    }
  }
  // Every slot its own entry, nothing generated after: a prefill of `slots` prompts.
  static KvCache prefill_only(int64_t layers, int64_t slots, int64_t prompt_capacity,
                              int64_t width) {
    KvCache c(layers, slots, prompt_capacity, slots, 0, width);
    for (int64_t s = 0; s < slots; ++s) c.entry[size_t(s)] = s;
    return c;
  }
  double bytes() const {
    double n = 0;
    for (size_t l = 0; l < k.size(); ++l) {
      n += double(prompt_k[l].nbytes() + prompt_v[l].nbytes() + k[l].nbytes() + v[l].nbytes());
    }
    return n;
  }
};

}  // namespace wl::infer
