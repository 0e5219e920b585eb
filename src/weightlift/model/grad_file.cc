#include "weightlift/model/grad_file.h"

#include "weightlift/core/safetensors.h"
#include "weightlift/model/transformer.h"

namespace wl::model {

Status write_gradient_file(const GradFileOptions& o) {
  WL_ASSIGN_OR_RETURN(ModelConfig cfg, load_config(o.config_path));
  WL_ASSIGN_OR_RETURN(SafetensorsFile batch, SafetensorsFile::open(o.tokens_path));
  const TensorInfo* info = batch.find("tokens");
  if (!info) return not_found(o.tokens_path + ": no tensor 'tokens'");
  if (info->shape.size() != 2)
    return invalid_argument(o.tokens_path + ": tensor 'tokens' has shape " +
                            shape_to_string(info->shape) + ", expected [batch, seq]");
  const int64_t B = info->shape[0], T = info->shape[1];
  WL_ASSIGN_OR_RETURN(Tensor tokens, batch.get("tokens", DType::kI64, {B, T}));
  WL_ASSIGN_OR_RETURN(Tensor targets, batch.get("targets", DType::kI64, {B, T}));
  if (T < 1 || T > cfg.max_seq_len)
    return invalid_argument(o.tokens_path + ": seq " + std::to_string(T) +
                            " outside [1, max_seq_len " + std::to_string(cfg.max_seq_len) + "]");
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t t = tokens.data<int64_t>()[i], y = targets.data<int64_t>()[i];
    if (t < 0 || t >= cfg.vocab_size)
      return invalid_argument(o.tokens_path + ": tokens[" + std::to_string(i) + "] = " +
                              std::to_string(t) + " outside the vocabulary");
    if (y != -100 && (y < 0 || y >= cfg.vocab_size))
      return invalid_argument(o.tokens_path + ": targets[" + std::to_string(i) + "] = " +
                              std::to_string(y) + " is neither -100 nor in the vocabulary");
  }

  Transformer model(cfg);
  WL_RETURN_IF_ERROR(model.load(o.weights_path));
  model.zero_grads();
  Tensor logits = Tensor::empty(DType::kF32, {B, T, cfg.vocab_size});
  LossTerms l = model.forward_backward(
      tokens.data<int64_t>(), targets.data<int64_t>(), B, T,
      {.precision = o.precision, .checkpointing = o.checkpointing,
       .logits_out = logits.data<float>()});

  auto scalar = [](double v) {
    Tensor t = Tensor::empty(DType::kF32, {1});
    t.data<float>()[0] = float(v);
    return t;
  };
  std::vector<std::pair<std::string, Tensor>> out{
      {"loss", scalar(l.loss())}, {"ce", scalar(l.ce)}, {"aux", scalar(l.aux)},
      {"z", scalar(l.z)}, {"logits", logits}};
  for (const ParamInfo& p : model.layout().params()) {
    out.emplace_back("grad." + p.name, Tensor::borrow(model.grads().data<float>() + p.offset,
                                                      DType::kF32, p.shape));
  }
  return write_safetensors(o.out_path, out, {{"producer", "weightlift grad"}});
}

}  // namespace wl::model
