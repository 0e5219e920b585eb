#include "weightlift/model/params.h"

#include <cmath>
#include <set>

#include "weightlift/core/random.h"
#include "weightlift/model/units.h"

namespace wl::model {

ParamLayout::ParamLayout(const ModelConfig& c) {
  const int64_t d = c.hidden_size, dh = c.head_dim, f = c.ffn_dim;
  using R = ParamRole;
  auto add = [&](std::string name, Shape shape, R role, int32_t expert = -1) {
    index_.emplace(name, params_.size());
    const bool decay = role != R::kNorm;
    params_.push_back({std::move(name), std::move(shape), total_, decay, expert, role});
    total_ += params_.back().numel();
  };
  add("embed.weight", {c.vocab_size, d}, R::kEmbed);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {d}, R::kNorm);
    add(p + "attn.q_proj.weight", {c.num_heads * dh, d}, R::kQ);
    add(p + "attn.k_proj.weight", {c.num_kv_heads * dh, d}, R::kK);
    add(p + "attn.v_proj.weight", {c.num_kv_heads * dh, d}, R::kV);
    add(p + "attn.o_proj.weight", {d, c.num_heads * dh}, R::kO);
    if (c.qk_norm) {
      add(p + "attn.q_norm.weight", {dh}, R::kNorm);
      add(p + "attn.k_norm.weight", {dh}, R::kNorm);
    }
    add(p + "moe_norm.weight", {d}, R::kNorm);
    if (c.dense_layer(l)) {
      add(p + "mlp.gate_proj.weight", {c.dense_ffn_dim, d}, R::kGate);
      add(p + "mlp.up_proj.weight", {c.dense_ffn_dim, d}, R::kUp);
      add(p + "mlp.down_proj.weight", {d, c.dense_ffn_dim}, R::kDown);
      continue;
    }
    add(p + "moe.router.weight", {c.num_experts, d}, R::kRouter);
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = p + "moe.experts." + std::to_string(e) + ".";
      add(q + "gate_proj.weight", {f, d}, R::kGate, int32_t(e));
      add(q + "up_proj.weight", {f, d}, R::kUp, int32_t(e));
      add(q + "down_proj.weight", {d, f}, R::kDown, int32_t(e));
    }
  }
  add("norm.weight", {d}, R::kNorm);
  if (!c.tie_embeddings) add("lm_head.weight", {c.vocab_size, d}, R::kHead);
}

const ParamInfo* ParamLayout::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &params_[it->second];
}

const ParamInfo& ParamLayout::at(std::string_view name) const {
  const ParamInfo* p = find(name);
  WL_CHECK(p != nullptr) << "no parameter named " << name;
  return *p;
}

namespace {
// FNV-1a: a name hash that, unlike std::hash, is the same on every standard library, so a
// seed gives the same weights everywhere.
uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
}  // namespace

void init_params(const ModelConfig& c, const ParamLayout& layout, uint64_t seed, float* out) {
  init_params(c, layout, seed, 0, layout.total(), out);
}

void init_params(const ModelConfig& c, const ParamLayout& layout, uint64_t seed, int64_t begin,
                 int64_t end, float* out) {
  const float residual_scale = 1.0f / std::sqrt(2.0f * float(c.num_layers));
  for (const ParamInfo& p : layout.params()) {
    if (p.offset + p.numel() <= begin || p.offset >= end) continue;
    WL_CHECK(p.offset >= begin && p.offset + p.numel() <= end)
        << p.name << " straddles [" << begin << ", " << end << ")";
    float* w = out + (p.offset - begin);
    if (p.shape.size() == 1) {
      for (int64_t i = 0; i < p.numel(); ++i) w[i] = 1.0f;
      continue;
    }
    // One stream per parameter, so a parameter's values do not depend on the others' sizes.
    Rng rng(seed ^ fnv1a(p.name));
    const bool residual = p.role == ParamRole::kO || p.role == ParamRole::kDown;
    const float std_dev = 0.02f * (residual ? residual_scale : 1.0f);
    for (int64_t i = 0; i < p.numel(); ++i) w[i] = std_dev * rng.normal();
  }
}

ModelView bind(const ModelConfig& c, const ParamLayout& layout, float* base) {
  const Units units(c, layout);
  ModelView v;
  for (int u = 0; u < units.count(); ++u) units.bind(u, base + units.range(u).begin, v);
  return v;
}

Status read_params(const ParamLayout& layout, std::span<const SafetensorsFile* const> files,
                   float* out) {
  return read_params(layout, files, out, [](const std::string& name) { return name; });
}

Status read_params(const ParamLayout& layout, std::span<const SafetensorsFile* const> files,
                   float* out, const std::function<std::string(const std::string&)>& stored_name) {
  std::set<std::string> seen;
  for (const ParamInfo& p : layout.params()) {
    const std::string name = stored_name(p.name);
    const SafetensorsFile* from = nullptr;
    for (const SafetensorsFile* f : files) {
      if (f->find(name) == nullptr) continue;
      if (from != nullptr) {
        return invalid_argument("tensor '" + name + "' is in both " + from->path() + " and " +
                                f->path());
      }
      from = f;
    }
    if (from == nullptr) {
      return not_found(
          (files.size() == 1 ? files[0]->path() : std::to_string(files.size()) + " files") +
          ": missing tensor '" + name + "'");
    }
    const TensorInfo* info = from->find(name);
    if (!dtype_is_float(info->dtype)) {
      return invalid_argument(from->path() + ": tensor '" + name + "' has dtype " +
                              std::string(dtype_name(info->dtype)) + ", expected a float type");
    }
    WL_ASSIGN_OR_RETURN(Tensor t, from->get(name, info->dtype, p.shape));
    convert_to_f32(t.dtype(), t.raw(), out + p.offset, size_t(p.numel()));
    seen.insert(name);
  }
  for (const SafetensorsFile* f : files) {
    for (const TensorInfo& t : f->tensors()) {
      if (!seen.count(t.name)) {
        return invalid_argument(f->path() + ": tensor '" + t.name +
                                "' is not a parameter of this config");
      }
    }
  }
  return ok_status();
}

}  // namespace wl::model
