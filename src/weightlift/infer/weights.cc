// bind_weights of weights.h: the layout says what must be there; every tensor is checked
// before any pointer is handed out, so a bad source fails here and never inside a GEMM.
#include "weightlift/infer/weights.h"

#include <unordered_map>

namespace wl::infer {

TensorLookup lookup_in(const transfer::Receiver& receiver,
                       const transfer::Receiver::ReadGuard& guard) {
  return [&receiver, &guard](std::string_view name) -> std::optional<Tensor> {
    if (receiver.find(name) == nullptr) return std::nullopt;
    return guard.tensor(name);
  };
}

TensorLookup lookup_in(const std::map<std::string, Tensor>& tensors) {
  return [&tensors](std::string_view name) -> std::optional<Tensor> {
    auto it = tensors.find(std::string(name));
    if (it == tensors.end()) return std::nullopt;
    return it->second;
  };
}

namespace {

std::string dtype_label(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kF8E4M3:
      return "fp8 e4m3";
    case DType::kF32:
      return "f32";
    default:
      return std::string(dtype_name(t));
  }
}

}  // namespace

Result<BoundWeights> bind_weights(const model::ModelConfig& c, const transfer::LayoutOptions& o,
                                  const TensorLookup& lookup) {
  WL_ASSIGN_OR_RETURN(std::vector<transfer::ReceiverTensor> layout,
                      transfer::inference_layout(c, o));
  const std::string where = "inference worker (" + transfer::describe_rank(o) + ", " +
                            std::string(transfer::weight_format_name(o.format)) + ")";
  std::unordered_map<std::string, Tensor> found;
  for (const transfer::ReceiverTensor& want : layout) {
    std::optional<Tensor> t = lookup(want.name);
    if (!t || !t->defined()) {
      return not_found(where + ": missing tensor '" + want.name + "' (" + dtype_label(want.dtype) +
                       " " + shape_to_string(want.shape) + ")");
    }
    if (t->dtype() != want.dtype) {
      return invalid_argument(where + ": tensor '" + want.name + "' is " + dtype_label(t->dtype()) +
                              ", expected " + dtype_label(want.dtype));
    }
    if (t->shape() != want.shape) {
      return invalid_argument(where + ": tensor '" + want.name + "' has shape " +
                              shape_to_string(t->shape()) + ", expected " +
                              shape_to_string(want.shape));
    }
    if (!t->is_contiguous()) {
      return invalid_argument(where + ": tensor '" + want.name + "' is a strided view");
    }
    found.emplace(want.name, *t);
  }

  auto vector = [&](const std::string& name) {
    return static_cast<const uint16_t*>(found.at(name).raw());
  };
  auto matrix = [&](const std::string& name) {
    const Tensor& t = found.at(name);
    WeightMatrix m{.dtype = t.dtype(), .data = t.raw(), .rows = t.size(0), .cols = t.size(1)};
    if (m.dtype == DType::kF8E4M3) m.scale = found.at(name + ".scale").data<float>();
    return m;
  };
  BoundWeights w;
  w.embed = matrix("embed.weight");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    BoundLayer b;
    b.attn_norm = vector(p + "attn_norm.weight");
    b.qkv = matrix(p + "attn.qkv_proj.weight");
    b.o = matrix(p + "attn.o_proj.weight");
    if (c.qk_norm) {
      b.q_norm = vector(p + "attn.q_norm.weight");
      b.k_norm = vector(p + "attn.k_norm.weight");
    }
    b.moe_norm = vector(p + "moe_norm.weight");
    if (c.dense_layer(l)) {
      b.mlp = {matrix(p + "mlp.gate_up_proj.weight"), matrix(p + "mlp.down_proj.weight")};
      w.layers.push_back(std::move(b));
      continue;
    }
    b.router = matrix(p + "moe.router.weight");
    const transfer::ExpertRun mine = transfer::expert_run(c, o);
    for (int64_t e = mine.begin; e < mine.end; ++e) {
      const std::string q = p + "moe.experts." + std::to_string(e) + ".";
      b.experts.push_back({matrix(q + "gate_up_proj.weight"), matrix(q + "down_proj.weight")});
    }
    w.layers.push_back(std::move(b));
  }
  w.norm = vector("norm.weight");
  w.head = c.tie_embeddings ? w.embed : matrix("lm_head.weight");
  return w;
}

}  // namespace wl::infer
