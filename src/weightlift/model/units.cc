// units.h.
#include "weightlift/model/units.h"

#include <string>

namespace wl::model {

Units::Units(const ModelConfig& config, const ParamLayout& layout)
    : config_(config), layout_(layout), tied_(config.tie_embeddings) {
  const int64_t L = config.num_layers;
  // Unit u starts where its first parameter does; it ends where the next unit starts.
  std::vector<int64_t> starts;
  starts.push_back(layout.at("embed.weight").offset);
  for (int64_t l = 0; l < L; ++l) {
    starts.push_back(layout.at("layers." + std::to_string(l) + ".attn_norm.weight").offset);
  }
  starts.push_back(layout.at("norm.weight").offset);
  starts.push_back(layout.total());
  for (size_t u = 0; u + 1 < starts.size(); ++u) ranges_.push_back({starts[u], starts[u + 1]});
  params_.resize(ranges_.size());
  size_t u = 0;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    while (layout.params()[i].offset >= ranges_[u].end) ++u;
    params_[u].push_back(i);
  }
}

void Units::bind(int unit, float* data, ModelView& v, int64_t first_expert,
                 int64_t held_experts) const {
  const int64_t base = ranges_[size_t(unit)].begin;
  auto at = [&](const std::string& name) { return data + (layout_.at(name).offset - base); };
  if (v.layers.size() != size_t(config_.num_layers)) v.layers.resize(size_t(config_.num_layers));
  if (unit == 0) {
    v.embed = data;
    if (tied_) v.head = data;
    return;
  }
  if (unit == head()) {
    v.norm = at("norm.weight");
    if (!tied_) v.head = at("lm_head.weight");
    return;
  }
  const std::string p = "layers." + std::to_string(unit - 1) + ".";
  LayerView& layer = v.layers[size_t(unit - 1)];
  layer = {.attn_norm = at(p + "attn_norm.weight"),
           .wqkv = at(p + "attn.q_proj.weight"),
           .wo = at(p + "attn.o_proj.weight"),
           .moe_norm = at(p + "moe_norm.weight")};
  if (config_.qk_norm) {
    layer.q_norm = at(p + "attn.q_norm.weight");
    layer.k_norm = at(p + "attn.k_norm.weight");
  }
  if (config_.dense_layer(unit - 1)) {
    layer.mlp = at(p + "mlp.gate_proj.weight");
    return;
  }
  // The experts sit after the block's dense parameters, so the first held one lands where
  // expert 0 is in the whole block.
  if (held_experts < 0) held_experts = config_.num_experts - first_expert;
  WL_CHECK(first_expert >= 0 && held_experts >= 0 &&
           first_expert + held_experts <= config_.num_experts)
      << "experts [" << first_expert << ", " << first_expert + held_experts << ") of "
      << config_.num_experts;
  layer.router = at(p + "moe.router.weight");
  layer.experts = at(p + "moe.experts.0.gate_proj.weight");
  layer.expert_stride = 3 * config_.ffn_dim * config_.hidden_size;
  layer.first_expert = first_expert;
  layer.held_experts = held_experts;
}

}  // namespace wl::model
