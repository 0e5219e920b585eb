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

class Source {
 public:
  Source(const model::ModelConfig& c, std::span<const float> full) : layout_(c), full_(full) {
    WL_CHECK_EQ(int64_t(full.size()), layout_.total());
  }
  // Rows [r0, r1), columns [c0, c1) of a parameter viewed as [rows, cols].
  Matrix block(const std::string& name, int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const model::ParamInfo& p = layout_.at(name);
    const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
    Matrix m{r1 - r0, c1 - c0, {}};
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t j = c0; j < c1; ++j) m.v.push_back(full_[size_t(p.offset + i * cols + j)]);
    }
    return m;
  }
  Matrix whole(const std::string& name) const {
    const model::ParamInfo& p = layout_.at(name);
    return block(name, 0, p.shape[0], 0, p.shape.size() == 2 ? p.shape[1] : 1);
  }

 private:
  model::ParamLayout layout_;
  std::span<const float> full_;
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

}  // namespace

std::map<std::string, ReferenceTensor> reference_receiver_tensors(const model::ModelConfig& c,
                                                                  const LayoutOptions& o,
                                                                  std::span<const float> full) {
  const Source src(c, full);
  const int64_t tp = o.tp, r = o.tp_rank, d = c.hidden_size, dh = c.head_dim;
  WL_CHECK(c.num_heads % tp == 0 && c.ffn_dim % tp == 0) << "tp " << tp;
  std::map<std::string, ReferenceTensor> out;
  const model::ParamLayout layout(c);
  auto put_plain = [&](const std::string& name) {
    Matrix m = src.whole(name);
    out[name] = to_bf16(m, layout.at(name).shape);
  };
  auto put_matrix = [&](const std::string& name, const Matrix& m) {
    if (o.format == WeightFormat::kBF16) {
      out[name] = to_bf16(m, {m.rows, m.cols});
    } else {
      quantize(m, &out[name], &out[name + ".scale"]);
    }
  };

  put_plain("embed.weight");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    put_plain(p + "attn_norm.weight");
    // Query heads h with h * tp / H == r; kv heads by the same rule, or, when there are fewer
    // kv heads than ranks, the kv head that query head (r * H / tp) uses (repeat_kv).
    const int64_t hq = c.num_heads / tp;
    std::vector<Matrix> qkv;
    for (int64_t h = r * hq; h < (r + 1) * hq; ++h) {
      qkv.push_back(src.block(p + "attn.q_proj.weight", h * dh, (h + 1) * dh, 0, d));
    }
    std::vector<int64_t> kv_heads;
    if (c.num_kv_heads >= tp) {
      for (int64_t h = 0; h < c.num_kv_heads; ++h) {
        if (h * tp / c.num_kv_heads == r) kv_heads.push_back(h);
      }
    } else {
      kv_heads.push_back(r * hq / (c.num_heads / c.num_kv_heads));
    }
    for (const char* w : {"k", "v"}) {
      for (int64_t h : kv_heads) {
        qkv.push_back(src.block(p + "attn." + w + "_proj.weight", h * dh, (h + 1) * dh, 0, d));
      }
    }
    put_matrix(p + "attn.qkv_proj.weight", stack(std::move(qkv)));
    put_matrix(p + "attn.o_proj.weight",
               src.block(p + "attn.o_proj.weight", 0, d, r * hq * dh, (r + 1) * hq * dh));
    put_plain(p + "moe_norm.weight");
    put_plain(p + "moe.router.weight");
    const int64_t f = c.ffn_dim / tp;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = p + "moe.experts." + std::to_string(e) + ".";
      put_matrix(q + "gate_up_proj.weight",
                 stack({src.block(q + "gate_proj.weight", r * f, (r + 1) * f, 0, d),
                        src.block(q + "up_proj.weight", r * f, (r + 1) * f, 0, d)}));
      put_matrix(q + "down_proj.weight",
                 src.block(q + "down_proj.weight", 0, d, r * f, (r + 1) * f));
    }
  }
  put_plain("norm.weight");
  if (!c.tie_embeddings) put_plain("lm_head.weight");
  return out;
}

}  // namespace wl::transfer
