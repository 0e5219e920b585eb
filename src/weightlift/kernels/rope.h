// Rotary position embedding, rotate-half convention, with NTK-aware scaling and the frequency
// rescalings of Hugging Face's `rope_scaling` that Llama checkpoints use.
//
// inv_freq[i] = base^(-2i / head_dim), i < head_dim/2, with
// base = theta * alpha^(head_dim / (head_dim - 2)), then rescaled (RopeScaling). For each
// head vector x at position p and
// each i < head_dim/2, pairs (x[i], x[i + head_dim/2]) rotate by angle p * inv_freq[i]:
//   x'[i]        = x[i] cos - x[i + h/2] sin
//   x'[i + h/2]  = x[i + h/2] cos + x[i] sin
#pragma once

#include <cstdint>
#include <vector>

namespace wl::kernels {

// kLinear: every inv_freq / factor (positions interpolated). kLlama3 (Llama 3.1): with
// wavelength w = 2 pi / inv_freq and the original context C, frequencies with
// w > C / low_freq_factor are divided by factor, those with w < C / high_freq_factor kept, and
// those between blended: s = (C / w - low) / (high - low), inv_freq ((1 - s) / factor + s).
struct RopeScaling {
  enum class Kind : uint8_t { kNone, kLinear, kLlama3 };
  Kind kind = Kind::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // kLlama3
  int64_t original_max_seq = 0;                          // kLlama3: C
};

struct RopeTable {
  int64_t max_seq = 0, head_dim = 0;
  std::vector<float> cos, sin;  // [max_seq, head_dim/2], computed in double then rounded
};

RopeTable make_rope_table(int64_t max_seq, int64_t head_dim, double theta, double ntk_alpha,
                          const RopeScaling& scaling = {});

// x: [batch, seq, heads, head_dim], rotated in place; token t of every batch row sits at
// position pos_offset + t (pos_offset > 0 when decoding with a KV cache).
void rope_forward(float* x, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
                  int64_t pos_offset);
// The inverse rotation (the transpose), applied in place to the gradient.
void rope_backward(float* dx, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
                   int64_t pos_offset);

}  // namespace wl::kernels
