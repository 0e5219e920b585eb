// The model's buffers (parameters, gradients), their initialisation and files, and a step as
// one StagePass over every unit (pass.h).
#include "weightlift/model/transformer.h"

#include <cmath>
#include <cstring>
#include <set>

#include "weightlift/core/random.h"

namespace wl::model {

Transformer::Transformer(const ModelConfig& config)
    : config_(config),
      layout_(config),
      units_(config_, layout_),
      params_(Tensor::zeros(DType::kF32, {layout_.total()})),
      grads_(Tensor::zeros(DType::kF32, {layout_.total()})),
      rope_(kernels::make_rope_table(config.max_seq_len, config.head_dim, config.rope_theta,
                                     config.rope_ntk_alpha)) {
  WL_CHECK(config.validate().ok()) << config.validate().to_string();
}

Transformer::~Transformer() = default;

namespace {
// FNV-1a: a name hash that, unlike std::hash, is the same on every standard library, so a
// seed gives the same weights everywhere.
uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
}  // namespace

void Transformer::init(uint64_t seed) {
  const float residual_scale = 1.0f / std::sqrt(2.0f * float(config_.num_layers));
  float* base = params_.data<float>();
  for (const ParamInfo& p : layout_.params()) {
    float* w = base + p.offset;
    if (p.shape.size() == 1) {
      for (int64_t i = 0; i < p.numel(); ++i) w[i] = 1.0f;
      continue;
    }
    // One stream per parameter, so a parameter's values do not depend on the others' sizes.
    Rng rng(seed ^ fnv1a(p.name));
    const bool residual = p.name.ends_with("o_proj.weight") || p.name.ends_with("down_proj.weight");
    const float std_dev = 0.02f * (residual ? residual_scale : 1.0f);
    for (int64_t i = 0; i < p.numel(); ++i) w[i] = std_dev * rng.normal();
  }
}

void Transformer::zero_grads() { grads_.fill_zero(); }

Status Transformer::load(const SafetensorsFile& file) {
  const SafetensorsFile* files[] = {&file};
  return read_params(layout_, files, params_.data<float>());
}

Status Transformer::load(const std::string& path) {
  WL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(path));
  return load(f);
}

Status Transformer::save(const std::string& path) const {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ParamInfo& p : layout_.params()) {
    tensors.emplace_back(p.name,
                         Tensor::borrow(params_.data<float>() + p.offset, DType::kF32, p.shape));
  }
  return write_safetensors(path, tensors, {{"format", "pt"}});
}

LossTerms Transformer::forward_backward(const int64_t* tokens, const int64_t* targets,
                                        int64_t batch, int64_t seq, const StepOptions& opts) {
  StagePass pass(pass_model(), {0, units_.head()}, tokens, batch, seq, opts, nullptr);
  pass.forward(nullptr, true);
  const LossTerms out = pass.loss(targets);
  pass.backward(nullptr);
  return out;
}

LossTerms Transformer::evaluate(const int64_t* tokens, const int64_t* targets, int64_t batch,
                                int64_t seq, const StepOptions& opts) {
  StagePass pass(pass_model(), {0, units_.head()}, tokens, batch, seq, opts, nullptr);
  pass.forward(nullptr, false);
  return pass.loss(targets);
}

}  // namespace wl::model
