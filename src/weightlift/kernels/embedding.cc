/* Token embedding: forward is a row gather, backward the matching scatter-add.
 *
 * Backward without atomics and without depending on the thread count: a counting sort groups
 * the positions by token (positions of one token stay in increasing order), then each thread
 * owns a contiguous range of vocabulary rows and adds, for each of its rows, the gradient
 * rows of that token's positions in order. So dtable[v] receives its terms in token order
 * whatever the split, and no two threads touch one row.
 *
 * Split: token frequencies are skewed (byte-level text is mostly spaces and a few letters),
 * so vocabulary rows are cut where the running position count crosses equal shares of n,
 * not into equal vocabulary ranges. Cost: O(n) for the sort, n * d adds.
 */
#include "weightlift/kernels/embedding.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/detail/simd.h"

namespace wl::kernels {
namespace {

void check_tokens(const int64_t* tokens, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    WL_CHECK(tokens[i] >= 0 && tokens[i] < vocab)
        << "position " << i << " token " << tokens[i] << " vocab " << vocab;
  }
}

WL_MULTIVERSION void add_row(float* dst, const float* src, int64_t d) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) dst[j] += src[j];
}

}  // namespace

void embedding_forward(const float* table, const int64_t* tokens, float* out, int64_t n,
                       int64_t vocab, int64_t d) {
  WL_CHECK(n >= 0 && vocab > 0 && d >= 0) << "n " << n << " vocab " << vocab << " d " << d;
  check_tokens(tokens, n, vocab);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, d));
  parallel_for(n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      std::memcpy(out + i * d, table + tokens[i] * d, size_t(d) * sizeof(float));
    }
  });
}

void embedding_backward(const float* dout, const int64_t* tokens, float* dtable, int64_t n,
                        int64_t vocab, int64_t d) {
  WL_CHECK(n >= 0 && vocab > 0 && d >= 0) << "n " << n << " vocab " << vocab << " d " << d;
  check_tokens(tokens, n, vocab);
  // offsets[v] .. offsets[v + 1]: the slots in `positions` holding token v's positions.
  std::vector<int64_t> offsets(size_t(vocab) + 1, 0), positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ++offsets[size_t(tokens[i]) + 1];
  for (int64_t v = 0; v < vocab; ++v) offsets[size_t(v) + 1] += offsets[size_t(v)];
  {
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < n; ++i) positions[size_t(fill[size_t(tokens[i])]++)] = i;
  }
  // Part p owns vocabulary rows [first_row(p), first_row(p + 1)): the rows whose positions
  // start in its equal share of [0, n).
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(4 * num_threads(), n / 64));
  auto first_row = [&](int64_t p) -> int64_t {
    if (p >= parts) return vocab;
    const int64_t share = n * p / parts;
    return std::lower_bound(offsets.begin(), offsets.end() - 1, share) - offsets.begin();
  };
  parallel_for(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t v = first_row(p0), v_end = first_row(p1); v < v_end; ++v) {
      float* row = dtable + v * d;
      for (int64_t s = offsets[size_t(v)]; s < offsets[size_t(v) + 1]; ++s) {
        add_row(row, dout + positions[size_t(s)] * d, d);
      }
    }
  });
}

}  // namespace wl::kernels
