// SwiGLU on a fused gate/up activation: h = x @ [W_gate; W_up]^T is [n, 2f] with the gate in
// columns [0, f) and up in [f, 2f); out[n, f] = silu(gate) * up, silu(g) = g * sigmoid(g).
#pragma once

#include <cstdint>

namespace wl::kernels {

void swiglu_forward(const float* h, float* out, int64_t n, int64_t f);

// dh [n, 2f] overwritten from dout [n, f] and the forward input h.
void swiglu_backward(const float* h, const float* dout, float* dh, int64_t n, int64_t f);

}  // namespace wl::kernels
