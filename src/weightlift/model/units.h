// The model as a chain of units, each a contiguous range of the flat parameter buffer
// (params.h lays parameters out in this order):
//   unit 0          the embedding   embed.weight
//   units 1 .. L    the blocks      layers.{u-1}.*
//   unit L + 1      the head        norm.weight, lm_head.weight (embed.weight when tied)
// A forward pass runs the units in order and a backward pass in reverse, so they are what the
// parallel trainers work in: FSDP gathers one unit's parameters at a time, DDP's gradient
// buckets fill as units finish their backward pass, a pipeline stage is a run of units.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/model/config.h"
#include "weightlift/model/params.h"

namespace wl::model {

struct FlatRange {
  int64_t begin = 0, end = 0;  // elements of the flat buffer
  int64_t size() const { return end - begin; }
};

class Units {
 public:
  Units(const ModelConfig& config, const ParamLayout& layout);

  int count() const { return int(ranges_.size()); }  // num_layers + 2
  int head() const { return count() - 1; }
  static int block(int layer) { return layer + 1; }
  // Elements of the flat buffer that unit u's own parameters take. With tied embeddings the
  // head reads unit 0's embed.weight as well (reads_embedding()).
  FlatRange range(int unit) const { return ranges_[size_t(unit)]; }
  // Indices into layout.params() of unit u's parameters, in buffer order.
  const std::vector<size_t>& params(int unit) const { return params_[size_t(unit)]; }
  bool reads_embedding(int unit) const { return unit == 0 || (unit == head() && tied_); }

  // Points unit u's entries of `view` at `data`, which holds the unit's range of a flat
  // buffer (range(u).size() floats). The head's tied lm_head stays on the embedding's entry.
  // An expert-parallel rank may hold only some of a block's experts: `data` is then the
  // block's dense parameters followed by experts [first_expert, first_expert + held_experts).
  void bind(int unit, float* data, ModelView& view, int64_t first_expert = 0,
            int64_t held_experts = -1) const;

 private:
  const ModelConfig& config_;
  const ParamLayout& layout_;
  bool tied_;
  std::vector<FlatRange> ranges_;
  std::vector<std::vector<size_t>> params_;
};

}  // namespace wl::model
