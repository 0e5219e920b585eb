// What a rank holds of each unit (model/units.h), as contiguous parts of the model's flat
// buffer. Without expert parallelism a unit is one part, its whole range. With --ep E a block
// is two: its dense parameters, summed over every data-parallel rank, and the run of experts
// this rank's expert group gives it, summed only over the ranks that run the same experts:
//
//   the model's block:  [ norms, attention, router | expert 0 | expert 1 | expert 2 | expert 3 ]
//   held, EP rank 1/2:  [ norms, attention, router | expert 2 | expert 3 ]
//                         part 0 (kData)             part 1 (kExpertData)
//
// The parts, back to back, are the unit's held buffer, the one a pass binds (bind()). The
// embedding and the head are one dense part each. Parameters never straddle parts, so a
// parameter's rows are always in one part and a checkpoint can name them as before.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/model/config.h"
#include "weightlift/model/params.h"
#include "weightlift/model/units.h"
#include "weightlift/parallel/data/over.h"

namespace wl::parallel {

struct UnitPart {
  model::FlatRange model;      // in the model's flat buffer
  std::vector<size_t> params;  // indices into ParamLayout::params(), in buffer order
  Over over = Over::kData;     // kExpertData: a block's run of experts
  int64_t held = 0;            // where it starts in the unit's held buffer
  int64_t size() const { return model.size(); }
};

class UnitParts {
 public:
  // ep: the expert-parallel size; ep_rank: this rank's place in its expert group, which runs
  // experts [ep_rank X/ep, (ep_rank + 1) X/ep) of every layer (X experts).
  UnitParts(const model::ModelConfig& config, const model::ParamLayout& layout,
            const model::Units& units, int ep, int ep_rank);

  const std::vector<UnitPart>& of(int unit) const { return parts_[size_t(unit)]; }
  int64_t held_elems(int unit) const;  // the parts' sizes added up
  bool divides_experts() const { return ep_ > 1; }
  int64_t first_expert() const { return first_expert_; }
  int64_t held_experts() const { return held_experts_; }
  // Points unit u's entries of `view` at its held buffer.
  void bind(int unit, float* held, model::ModelView& view) const;

  // The data-parallel ranks of a stage that keep shards of parameter p, in shard order: every
  // one for a dense parameter; for expert e, the ranks g ep + e / (X / ep) of each expert
  // group g. The trainer's parts and the checkpoint index both come from this rule.
  static std::vector<int> holders(const model::ParamInfo& p, int dp, int ep, int64_t experts);

 private:
  const model::Units& units_;
  int ep_;
  int64_t first_expert_ = 0, held_experts_ = 0;
  std::vector<std::vector<UnitPart>> parts_;  // per unit
};

}  // namespace wl::parallel
