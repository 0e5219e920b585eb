// Token embedding lookup and its backward (scatter-add).
#pragma once

#include <cstdint>

namespace wl::kernels {

// out[i, :] = table[tokens[i], :]; table [vocab, d], out [n, d]; tokens checked < vocab.
void embedding_forward(const float* table, const int64_t* tokens, float* out, int64_t n,
                       int64_t vocab, int64_t d);

// dtable[tokens[i], :] += dout[i, :]. Deterministic (rows summed in token order) and
// parallel over disjoint vocabulary rows, so no atomics.
void embedding_backward(const float* dout, const int64_t* tokens, float* dtable, int64_t n,
                        int64_t vocab, int64_t d);

}  // namespace wl::kernels
