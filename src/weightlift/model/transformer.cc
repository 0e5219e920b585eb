// The model's buffers (parameters, gradients), their initialisation and files, and a step as
// one StagePass over every unit (pass.h).
#include "weightlift/model/transformer.h"

#include <cmath>
#include <cstring>
#include <set>

namespace wl::model {

Transformer::Transformer(const ModelConfig& config)
    : config_(config),
      layout_(config),
      units_(config_, layout_),
      params_(Tensor::zeros(DType::kF32, {layout_.total()})),
      grads_(Tensor::zeros(DType::kF32, {layout_.total()})),
      rope_(model::make_rope_table(config)) {
  WL_CHECK(config.validate().ok()) << config.validate().to_string();
}

Transformer::~Transformer() = default;

void Transformer::init(uint64_t seed) {
  init_params(config_, layout_, seed, params_.data<float>());
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
  StepOptions o = opts;
  o.targets = targets;
  StagePass pass(pass_model(), {0, units_.head()}, tokens, batch, seq, o, nullptr);
  // No hooks: nothing that could fail.
  WL_CHECK(pass.forward(nullptr, true).ok());
  const LossTerms out = pass.loss(targets);
  WL_CHECK(pass.backward(nullptr).ok());
  return out;
}

LossTerms Transformer::evaluate(const int64_t* tokens, const int64_t* targets, int64_t batch,
                                int64_t seq, const StepOptions& opts) {
  StepOptions o = opts;
  o.targets = targets;
  StagePass pass(pass_model(), {0, units_.head()}, tokens, batch, seq, o, nullptr);
  WL_CHECK(pass.forward(nullptr, false).ok());
  return pass.loss(targets);
}

}  // namespace wl::model
