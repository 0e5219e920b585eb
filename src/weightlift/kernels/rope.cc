// Rotary position embedding (rotate-half convention, NTK-aware base), forward and backward.
//
// Each head vector is read as head_dim/2 planar pairs (x[i], x[i + head_dim/2]), and pair i at
// position p is rotated by the angle p * inv_freq[i]:
//   x'[i] = x[i] cos - x[i + h/2] sin,   x'[i + h/2] = x[i + h/2] cos + x[i] sin.
// A rotation is orthogonal, so the backward pass is the rotation by -angle (the transpose):
//   dx[i] = dy[i] cos + dy[i + h/2] sin,   dx[i + h/2] = dy[i + h/2] cos - dy[i] sin.
// NTK-aware scaling stretches the base rather than the positions,
// base = theta * alpha^(head_dim / (head_dim - 2)), so the highest frequency (i = 0) is unchanged
// and the lowest is divided by exactly alpha, which extends the usable context by about alpha
// without fine-tuning.
//
// The table holds cos and sin for every (position, pair), computed in double and rounded once,
// so the angles p * inv_freq never suffer f32 cancellation at long positions. Applying it is
// in place, parallel over (batch, position) rows, and vectorised over the pairs of a head.
// Cost: 6 FLOPs per pair, i.e. 3 per element; memory: x read and written once, plus one table
// row (head_dim floats) per position, shared by all heads and batch rows.
#include "weightlift/kernels/rope.h"

#include <algorithm>
#include <cmath>

#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/detail/simd.h"

namespace wl::kernels {
namespace {

// sign = +1: forward rotation; -1: the inverse. One function so both directions share the code
// that the tests check; the sign multiplies sin only, which is exact.
WL_MULTIVERSION void rotate_rows(float* x, const RopeTable& table, int64_t row_begin,
                                 int64_t row_end, int64_t seq, int64_t heads, int64_t pos_offset,
                                 float sign) {
  const int64_t hd = table.head_dim, half = hd / 2;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t pos = pos_offset + row % seq;
    const float* c = table.cos.data() + pos * half;
    const float* s = table.sin.data() + pos * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* lo = x + (row * heads + h) * hd;
      float* hi = lo + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = lo[i], b = hi[i], sn = sign * s[i];
        lo[i] = a * c[i] - b * sn;
        hi[i] = b * c[i] + a * sn;
      }
    }
  }
}

void rotate(float* x, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
            int64_t pos_offset, float sign) {
  WL_CHECK(batch >= 0 && seq >= 0 && heads >= 0 && pos_offset >= 0)
      << "batch " << batch << " seq " << seq << " heads " << heads << " pos_offset " << pos_offset;
  WL_CHECK_LE(pos_offset + seq, table.max_seq);
  WL_CHECK_EQ(int64_t(table.cos.size()), table.max_seq * (table.head_dim / 2));
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * table.head_dim));
  parallel_for(batch * seq, grain, [&](int64_t begin, int64_t end) {
    rotate_rows(x, table, begin, end, seq, heads, pos_offset, sign);
  });
}

}  // namespace

namespace {

double scaled(double inv_freq, const RopeScaling& s) {
  using K = RopeScaling::Kind;
  if (s.kind == K::kLinear) return inv_freq / s.factor;
  if (s.kind != K::kLlama3) return inv_freq;
  const double wavelen = 2.0 * M_PI / inv_freq, old = double(s.original_max_seq);
  if (wavelen > old / s.low_freq_factor) return inv_freq / s.factor;
  if (wavelen < old / s.high_freq_factor) return inv_freq;
  const double smooth =
      (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq;
}

}  // namespace

RopeTable make_rope_table(int64_t max_seq, int64_t head_dim, double theta, double ntk_alpha,
                          const RopeScaling& scaling) {
  WL_CHECK(max_seq >= 0 && head_dim > 0 && head_dim % 2 == 0)
      << "max_seq " << max_seq << " head_dim " << head_dim;
  WL_CHECK(theta > 0 && ntk_alpha > 0) << "theta " << theta << " ntk_alpha " << ntk_alpha;
  WL_CHECK(scaling.kind == RopeScaling::Kind::kNone || scaling.factor > 0) << scaling.factor;
  WL_CHECK(scaling.kind != RopeScaling::Kind::kLlama3 ||
           (scaling.original_max_seq > 0 && scaling.high_freq_factor > scaling.low_freq_factor &&
            scaling.low_freq_factor > 0))
      << "llama3 RoPE scaling: original " << scaling.original_max_seq << " low "
      << scaling.low_freq_factor << " high " << scaling.high_freq_factor;
  // head_dim 2 has no NTK exponent (0 in the denominator); it is only meaningful unscaled.
  WL_CHECK(head_dim > 2 || ntk_alpha == 1.0)
      << "head_dim " << head_dim << " ntk_alpha " << ntk_alpha;
  RopeTable t;
  t.max_seq = max_seq;
  t.head_dim = head_dim;
  const int64_t half = head_dim / 2;
  const double base = ntk_alpha == 1.0
                          ? theta
                          : theta * std::pow(ntk_alpha, double(head_dim) / double(head_dim - 2));
  t.cos.resize(size_t(max_seq * half));
  t.sin.resize(size_t(max_seq * half));
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = scaled(std::pow(base, -2.0 * double(i) / double(head_dim)), scaling);
    for (int64_t p = 0; p < max_seq; ++p) {
      const double angle = double(p) * inv_freq;
      t.cos[size_t(p * half + i)] = float(std::cos(angle));
      t.sin[size_t(p * half + i)] = float(std::sin(angle));
    }
  }
  return t;
}

void rope_forward(float* x, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
                  int64_t pos_offset) {
  rotate(x, table, batch, seq, heads, pos_offset, 1.0f);
}

void rope_backward(float* dx, const RopeTable& table, int64_t batch, int64_t seq, int64_t heads,
                   int64_t pos_offset) {
  rotate(dx, table, batch, seq, heads, pos_offset, -1.0f);
}

}  // namespace wl::kernels
