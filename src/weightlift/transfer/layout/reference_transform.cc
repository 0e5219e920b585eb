// The reference transform of layout/reference_transform.h: gather rows or columns into an f32
// matrix, then cast or block-quantize it with scalar loops.
#include "weightlift/transfer/layout/reference_transform.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "weightlift/core/check.h"
#include "weightlift/model/params.h"

namespace wl::transfer {
namespace {

struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> v;  // [rows, cols]
};

// The trainer's parameters by name, each f32 [rows, cols] (a 1-D [n] is [n, 1]).
class Source {
 public:
  struct Param {
    Shape shape;
    const float* data = nullptr;
  };
  void add(const std::string& name, Shape shape, const float* data) {
    params_[name] = {std::move(shape), data};
  }
  const Shape& shape(const std::string& name) const { return at(name).shape; }
  // Rows [r0, r1), columns [c0, c1) of a parameter viewed as [rows, cols].
  Matrix block(const std::string& name, int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const Param& p = at(name);
    const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
    Matrix m{r1 - r0, c1 - c0, {}};
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t j = c0; j < c1; ++j) m.v.push_back(p.data[i * cols + j]);
    }
    return m;
  }
  Matrix whole(const std::string& name) const {
    const Shape& s = shape(name);
    return block(name, 0, s[0], 0, s.size() == 2 ? s[1] : 1);
  }

 private:
  const Param& at(const std::string& name) const {
    auto it = params_.find(name);
    WL_CHECK(it != params_.end()) << "reference transform: no parameter '" << name << "'";
    return it->second;
  }
  std::map<std::string, Param> params_;
};

Matrix stack(std::vector<Matrix> parts) {
  Matrix m{0, parts.front().cols, {}};
  for (Matrix& p : parts) {
    WL_CHECK_EQ(p.cols, m.cols);
    m.rows += p.rows;
    m.v.insert(m.v.end(), p.v.begin(), p.v.end());
  }
  return m;
}

ReferenceTensor to_bf16(const Matrix& m, Shape shape) {
  ReferenceTensor t{DType::kBF16, std::move(shape), std::vector<std::byte>(m.v.size() * 2)};
  for (size_t i = 0; i < m.v.size(); ++i) {
    const uint16_t b = f32_to_bf16(m.v[i]);
    std::memcpy(t.bytes.data() + 2 * i, &b, 2);
  }
  return t;
}

void quantize(const Matrix& m, ReferenceTensor* q, ReferenceTensor* s) {
  const int64_t B = 128;
  const int64_t br = (m.rows + B - 1) / B, bc = (m.cols + B - 1) / B;
  *q = {DType::kF8E4M3, {m.rows, m.cols}, std::vector<std::byte>(size_t(m.rows * m.cols))};
  *s = {DType::kF32, {br, bc}, std::vector<std::byte>(size_t(br * bc) * 4)};
  for (int64_t bi = 0; bi < br; ++bi) {
    for (int64_t bj = 0; bj < bc; ++bj) {
      const int64_t i1 = std::min(m.rows, (bi + 1) * B), j1 = std::min(m.cols, (bj + 1) * B);
      float amax = 0.0f;
      for (int64_t i = bi * B; i < i1; ++i) {
        for (int64_t j = bj * B; j < j1; ++j)
          amax = std::max(amax, std::fabs(m.v[size_t(i * m.cols + j)]));
      }
      const float scale = amax == 0.0f ? 1.0f : amax / 448.0f;
      std::memcpy(s->bytes.data() + 4 * (bi * bc + bj), &scale, 4);
      for (int64_t i = bi * B; i < i1; ++i) {
        for (int64_t j = bj * B; j < j1; ++j) {
          const size_t k = size_t(i * m.cols + j);
          q->bytes[k] = std::byte{f32_to_fp8_e4m3(m.v[k] / scale)};
        }
      }
    }
  }
}

// Receiver tensors one at a time, for TP rank r of tp: the fused attention and MLP matrices
// (qkv_proj, o_proj, gate_up_proj, down_proj under a prefix, as our model and Hugging Face's
// Llama name them alike) and plain tensors replicated whole.
class Reference {
 public:
  Reference(const model::ModelConfig& c, const LayoutOptions& o, const Source& src)
      : c_(c), o_(o), src_(src) {
    WL_CHECK(c.num_heads % o.tp == 0 && c.ffn_dim % o.tp == 0 && c.dense_ffn_dim % o.tp == 0)
        << "tp " << o.tp;
  }

  void plain(const std::string& name) { out_[name] = to_bf16(src_.whole(name), src_.shape(name)); }

  // Query heads h with h * tp / H == r; kv heads by the same rule, or, when there are fewer kv
  // heads than ranks, the kv head that query head (r * H / tp) uses (repeat_kv). o_proj: the
  // input columns of this rank's query heads.
  void attention(const std::string& p) {
    const int64_t tp = o_.tp, r = o_.tp_rank, d = c_.hidden_size, dh = c_.head_dim;
    const int64_t hq = c_.num_heads / tp;
    std::vector<Matrix> qkv;
    for (int64_t h = r * hq; h < (r + 1) * hq; ++h) {
      qkv.push_back(src_.block(p + "q_proj.weight", h * dh, (h + 1) * dh, 0, d));
    }
    std::vector<int64_t> kv_heads;
    if (c_.num_kv_heads >= tp) {
      for (int64_t h = 0; h < c_.num_kv_heads; ++h) {
        if (h * tp / c_.num_kv_heads == r) kv_heads.push_back(h);
      }
    } else {
      kv_heads.push_back(r * hq / (c_.num_heads / c_.num_kv_heads));
    }
    for (const char* w : {"k", "v"}) {
      for (int64_t h : kv_heads) {
        qkv.push_back(src_.block(p + w + "_proj.weight", h * dh, (h + 1) * dh, 0, d));
      }
    }
    matrix(p + "qkv_proj.weight", stack(std::move(qkv)));
    matrix(p + "o_proj.weight",
           src_.block(p + "o_proj.weight", 0, d, r * hq * dh, (r + 1) * hq * dh));
  }

  // gate_up_proj: this rank's ffn rows of gate, then of up; down_proj: those input columns.
  void mlp(const std::string& p) {
    const int64_t r = o_.tp_rank, d = c_.hidden_size;
    const int64_t f = src_.shape(p + "gate_proj.weight")[0] / o_.tp;  // an expert's or dense
    matrix(p + "gate_up_proj.weight",
           stack({src_.block(p + "gate_proj.weight", r * f, (r + 1) * f, 0, d),
                  src_.block(p + "up_proj.weight", r * f, (r + 1) * f, 0, d)}));
    matrix(p + "down_proj.weight", src_.block(p + "down_proj.weight", 0, d, r * f, (r + 1) * f));
  }

  std::map<std::string, ReferenceTensor> take() { return std::move(out_); }

 private:
  void matrix(const std::string& name, const Matrix& m) {
    if (o_.format == WeightFormat::kBF16) {
      out_[name] = to_bf16(m, {m.rows, m.cols});
    } else {
      quantize(m, &out_[name], &out_[name + ".scale"]);
    }
  }

  const model::ModelConfig& c_;
  const LayoutOptions& o_;
  const Source& src_;
  std::map<std::string, ReferenceTensor> out_;
};

}  // namespace

std::map<std::string, ReferenceTensor> reference_receiver_tensors(const model::ModelConfig& c,
                                                                  const LayoutOptions& o,
                                                                  std::span<const float> full) {
  const model::ParamLayout layout(c);
  WL_CHECK_EQ(int64_t(full.size()), layout.total());
  Source src;
  for (const model::ParamInfo& p : layout.params())
    src.add(p.name, p.shape, full.data() + p.offset);
  Reference ref(c, o, src);
  ref.plain("embed.weight");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    ref.plain(p + "attn_norm.weight");
    ref.attention(p + "attn.");
    if (c.qk_norm) {
      ref.plain(p + "attn.q_norm.weight");
      ref.plain(p + "attn.k_norm.weight");
    }
    ref.plain(p + "moe_norm.weight");
    if (c.dense_layer(l)) {
      ref.mlp(p + "mlp.");
      continue;
    }
    ref.plain(p + "moe.router.weight");
    for (int64_t e = 0; e < c.num_experts; ++e) {  // EP rank r: experts e with e ep / E == r
      if (e * o.ep / c.num_experts == o.ep_rank)
        ref.mlp(p + "moe.experts." + std::to_string(e) + ".");
    }
  }
  ref.plain("norm.weight");
  if (!c.tie_embeddings) ref.plain("lm_head.weight");
  return ref.take();
}

std::map<std::string, ReferenceTensor> reference_llama_hf_tensors(
    const model::ModelConfig& c, const LayoutOptions& o,
    const std::map<std::string, std::vector<float>>& params,
    const std::map<std::string, Shape>& shapes) {
  Source src;
  for (const auto& [name, values] : params) src.add(name, shapes.at(name), values.data());
  Reference ref(c, o, src);
  ref.plain("model.embed_tokens.weight");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ref.plain(p + "input_layernorm.weight");
    ref.attention(p + "self_attn.");
    ref.plain(p + "post_attention_layernorm.weight");
    ref.mlp(p + "mlp.");
  }
  ref.plain("model.norm.weight");
  if (!c.tie_embeddings) ref.plain("lm_head.weight");
  return ref.take();
}

}  // namespace wl::transfer
