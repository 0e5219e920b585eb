// unit_parts.h.
#include "weightlift/parallel/data/unit_parts.h"

#include <string>

#include "weightlift/core/check.h"

namespace wl::parallel {

UnitParts::UnitParts(const model::ModelConfig& config, const model::ParamLayout& layout,
                     const model::Units& units, int ep, int ep_rank)
    : units_(units), ep_(ep) {
  const int64_t experts = config.num_experts;
  WL_CHECK(ep >= 1 && (ep == 1 || experts % ep == 0) && ep_rank >= 0 && ep_rank < ep)
      << "expert rank " << ep_rank << " of " << ep << " over " << experts << " experts";
  held_experts_ = experts / ep;
  first_expert_ = int64_t(ep_rank) * held_experts_;
  const int64_t stride = 3 * config.ffn_dim * config.hidden_size;
  parts_.resize(size_t(units.count()));
  for (int u = 0; u < units.count(); ++u) {
    const model::FlatRange range = units.range(u);
    const bool moe_block = u != 0 && u != units.head() && !config.dense_layer(u - 1);
    if (ep == 1 || !moe_block) {
      parts_[size_t(u)].push_back({range, units.params(u), Over::kData, 0});
      continue;
    }
    const std::string first = "layers." + std::to_string(u - 1) + ".moe.experts.0.gate_proj.weight";
    const int64_t x0 = layout.at(first).offset;
    UnitPart dense{{range.begin, x0}, {}, Over::kData, 0};
    UnitPart own{{x0 + first_expert_ * stride, x0 + (first_expert_ + held_experts_) * stride},
                 {},
                 Over::kExpertData,
                 x0 - range.begin};
    for (size_t i : units.params(u)) {
      const int32_t e = layout.params()[i].expert;
      if (e < 0) {
        dense.params.push_back(i);
      } else if (e >= first_expert_ && e < first_expert_ + held_experts_) {
        own.params.push_back(i);
      }
    }
    // The experts are the block's tail (params.h's order): the run is inside the block.
    WL_CHECK_EQ(range.end, x0 + experts * stride) << "unit " << u << "'s experts end it";
    parts_[size_t(u)].push_back(std::move(dense));
    parts_[size_t(u)].push_back(std::move(own));
  }
}

int64_t UnitParts::held_elems(int unit) const {
  int64_t n = 0;
  for (const UnitPart& p : of(unit)) n += p.size();
  return n;
}

void UnitParts::bind(int unit, float* held, model::ModelView& view) const {
  units_.bind(unit, held, view, first_expert_, held_experts_);
}

std::vector<int> UnitParts::holders(const model::ParamInfo& p, int dp, int ep, int64_t experts) {
  std::vector<int> out;
  if (p.expert < 0 || ep == 1) {
    for (int r = 0; r < dp; ++r) out.push_back(r);
    return out;
  }
  const int at = int(p.expert / (experts / ep));
  for (int g = 0; g < dp / ep; ++g) out.push_back(g * ep + at);
  return out;
}

}  // namespace wl::parallel
