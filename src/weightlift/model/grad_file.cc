#include "weightlift/model/grad_file.h"

#include <optional>

#include "weightlift/core/file_io.h"
#include "weightlift/core/safetensors.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/memory_estimate.h"
#include "weightlift/model/token_batch.h"
#include "weightlift/model/transformer.h"

namespace wl::model {

Status write_gradient_file(const GradFileOptions& o) {
  // Before any work: the output may replace neither an input nor anything but a regular file.
  WL_RETURN_IF_ERROR(check_output_file(o.out_path).with_context("`out_path`"));
  WL_RETURN_IF_ERROR(
      check_output_is_not_input({"`out_path`", o.out_path}, {{"`config_path`", o.config_path},
                                                             {"`weights_path`", o.weights_path},
                                                             {"`tokens_path`", o.tokens_path}}));
  std::optional<HfCheckpoint> hf;
  if (!o.model_dir.empty()) {
    WL_ASSIGN_OR_RETURN(hf, open_hf_checkpoint(o.model_dir));
    for (const std::string& f : hf->files) {
      WL_RETURN_IF_ERROR(
          check_output_is_not_input({"`out_path`", o.out_path}, {{"`model_dir`", f}}));
    }
  }
  ModelConfig cfg;
  if (hf) {
    cfg = hf->config;
  } else {
    WL_ASSIGN_OR_RETURN(cfg, load_config(o.config_path));
  }
  WL_ASSIGN_OR_RETURN(TokenBatch batch, load_token_batch(o.tokens_path, cfg));
  const int64_t B = batch.batch, T = batch.seq;
  WL_RETURN_IF_ERROR(check_grad_memory(cfg, hf ? o.model_dir : o.config_path, B, T));

  Transformer model(cfg);
  if (hf) {
    WL_RETURN_IF_ERROR(read_hf_params(*hf, model.params().data<float>()));
  } else {
    WL_RETURN_IF_ERROR(model.load(o.weights_path));
  }
  model.zero_grads();
  Tensor logits = Tensor::empty(DType::kF32, {B, T, cfg.vocab_size});
  LossTerms l = model.forward_backward(batch.tokens.data(), batch.targets.data(), B, T,
                                       {.precision = o.precision,
                                        .checkpointing = o.checkpointing,
                                        .logits_out = logits.data<float>()});

  auto scalar = [](double v) {
    Tensor t = Tensor::empty(DType::kF32, {1});
    t.data<float>()[0] = float(v);
    return t;
  };
  std::vector<std::pair<std::string, Tensor>> out{{"loss", scalar(l.loss())},
                                                  {"ce", scalar(l.ce)},
                                                  {"aux", scalar(l.aux)},
                                                  {"z", scalar(l.z)},
                                                  {"logits", logits}};
  if (cfg.capacity_factor) {  // the slots dropped over capacity, summed over layers
    Tensor dropped = Tensor::empty(DType::kI64, {1});
    dropped.data<int64_t>()[0] = l.dropped;
    out.emplace_back("dropped_slots", dropped);
  }
  for (const ParamInfo& p : model.layout().params()) {
    out.emplace_back("grad." + (hf ? hf_tensor_name(p.name, hf->family) : p.name),
                     Tensor::borrow(model.grads().data<float>() + p.offset, DType::kF32, p.shape));
  }
  return write_safetensors(o.out_path, out, {{"producer", "weightlift grad"}});
}

}  // namespace wl::model
