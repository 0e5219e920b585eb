// Rotary position embedding, rotate-half convention, with NTK-aware scaling.
//
// inv_freq[i] = base^(-2i / head_dim), i < head_dim/2, with
// base = theta * alpha^(head_dim / (head_dim - 2)). For each head vector x at position p and
// each i < head_dim/2, pairs (x[i], x[i + head_dim/2]) rotate by angle p * inv_freq[i]:
//   x'[i]        = x[i] cos - x[i + h/2] sin
//   x'[i + h/2]  = x[i + h/2] cos + x[i] sin
#pragma once

#include <cstdint>
#include <vector>

namespace wl::kernels {

struct RopeTable {
  int64_t max_seq = 0, head_dim = 0;
  std::vector<float> cos, sin;  // [max_seq, head_dim/2], computed in double then rounded
};

RopeTable make_rope_table(int64_t max_seq, int64_t head_dim, double theta, double ntk_alpha);

// x: [batch, seq, heads, head_dim], rotated in place; token t of every batch row sits at
// position pos_offset + t (pos_offset > 0 when decoding with a KV cache).
void rope_forward(float* x, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
                  int64_t pos_offset);
// The inverse rotation (the transpose), applied in place to the gradient.
void rope_backward(float* dx, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
                   int64_t pos_offset);

}  // namespace wl::kernels
