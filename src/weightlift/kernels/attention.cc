// Causal GQA/MQA attention, flash style (FlashAttention-2's loop order, on CPU tiles).
//
// Work is cut into tiles of query rows that share one kv head: a tile holds `tile_pos`
// consecutive positions times the `group = heads / kv_heads` query heads reading that kv head
// (about 64 rows), so each key/value row loaded is used by the whole group at once, which is
// where MQA's bandwidth saving comes from on a CPU. Per tile, the forward pass walks key blocks
// of 64 in order and keeps, per row, the running maximum m and sum l of the online softmax:
//   S^T = K_blk . Q^T                    scores in base-2 units (Q is pre-scaled by
//                                         log2(e)/sqrt(head_dim), so exp becomes exp2)
//   m' = max(m, max_j S), P = 2^(S - m'), l = l 2^(m - m') + sum_j P, O = O 2^(m - m') + P . V
// and at the end O / l and lse = (m + log2 l) ln 2. The [seq_q, seq_kv] score matrix never
// exists; the biggest buffer is one [64 keys, 64 rows] block, which stays in L1.
// Scores are kept transposed (keys x rows) so that the softmax runs down columns: the row
// maximum, the exponentials and the row sums are all vertical vector operations, with no
// horizontal reduction, and K is read in place (as the broadcast operand) with no transposing
// copy. Causality is applied per block: blocks every row of the tile can see wholly are not
// masked, blocks past the last row's position are never visited, and only the blocks that
// straddle the diagonal are masked element by element (with -inf, which exp2 turns into 0).
//
// The backward pass recomputes P block by block from the saved lse, with
// D = rowsum(dO * O), then per key block (5 tile GEMMs):
//   S^T = K_blk . Q^T, P^T = 2^(S^T - lse), dP^T = V_blk . dO^T, dS^T = P^T * (dP^T - D),
//   dV_blk += P^T . dO, dK_blk += dS^T . Q, dQ += dS . K_blk
// (dq and dk are scaled by 1/sqrt(head_dim) at the end). dQ for a tile is owned by the tile.
// dK and dV sum over every query row of every head in the group, so a unit of work is
// (batch, kv head, chunk of tiles) and each unit accumulates into its own [seq_kv, head_dim]
// partials, added up afterwards in chunk order. The chunk count depends only on the shape, so
// the result is bitwise the same for any thread count. Tiles are dealt to chunks in a snake
// order (0 1 2 3 3 2 1 0 ...) so chunks get similar causal work.
//
// k and v are read with kv_batch_stride in both passes (the same pointers that went through the
// forward pass); dk and dv are written dense.
//
// Units of work (forward: one tile; backward: one chunk) are claimed by the pool's threads one
// at a time (parallel_for_each), most expensive first, so which thread runs one changes no
// result and both cores stay busy when causal tiles differ in cost. The tile GEMMs are
// detail/tile_gemm.h; the exponential is detail/simd.h's exp2_v; both are compiled in an AVX2 + FMA
// version and an SSE2 version, picked at load time.
//
// Cost, with pairs = sum over query rows of visible keys (~ seq_q seq_kv - seq_q^2 / 2 when
// training) per (batch, head):
//   forward  4 pairs head_dim FLOPs and `pairs` exp2, per (batch, head)
//   backward 10 pairs head_dim FLOPs and `pairs` exp2, per (batch, head)
// plus the masked keys on the diagonal: the rows of a tile share one key range, so each row
// computes up to tile_pos - 1 scores past its own position (7 for the small preset's MQA).
// Memory: q, out, dout, dq streamed once; k and v once per query tile (from cache: one kv head
// of one batch row is seq_kv * head_dim * 8 bytes); backward scratch
// batch * kv_heads * chunks * seq_kv * head_dim * 8 bytes of f32 partials.
#include "weightlift/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "weightlift/core/check.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/detail/simd.h"
#include "weightlift/kernels/detail/tile_gemm.h"

// The 8-lane vectors of detail/simd.h are passed only between inlined functions in this file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace wl::kernels {
namespace {

using detail::F32v;
using detail::load_v;
using detail::splat_v;
using detail::store_v;

constexpr int64_t kPad = 8;  // tile widths are padded to 8 floats: a multiple of any vector width
constexpr int64_t kKeyBlock = 64;       // keys per block: S^T block [64, rows] = 16 KiB, in L1
constexpr int64_t kTileRows = 64;       // query rows per tile (positions x group), before padding
constexpr int64_t kBackwardUnits = 16;  // aim for this many backward units; shape-only, see top
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

struct Geometry {
  AttentionShape s;
  int64_t group = 0;       // query heads per kv head
  int64_t dp = 0;          // head_dim rounded up to 8: the width of the tile buffers
  int64_t tile_pos = 0;    // query positions per tile
  int64_t rows = 0;        // tile rows (tile_pos * group) rounded up to 8
  int64_t n_tiles = 0;     // query tiles per (batch, kv head)
  int64_t kv_bstride = 0;  // elements between batch rows of k and v
  int64_t kv_rstride = 0;  // elements between positions of k and v: kv_heads * head_dim
  float score_scale = 0;   // log2(e) / sqrt(head_dim): scores in base-2 units
  std::span<const KvSegment> segments;  // forward only: the keys and values, when paged
};

Geometry make_geometry(const AttentionShape& s) {
  WL_CHECK(s.batch >= 0 && s.seq_q >= 0 && s.q_offset >= 0 && s.head_dim > 0)
      << "batch " << s.batch << " seq_q " << s.seq_q << " q_offset " << s.q_offset << " head_dim "
      << s.head_dim;
  WL_CHECK(s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0)
      << "heads " << s.heads << " kv_heads " << s.kv_heads;
  WL_CHECK_LE(s.q_offset + s.seq_q, s.seq_kv);
  Geometry g;
  g.s = s;
  g.group = s.heads / s.kv_heads;
  g.dp = round_up(s.head_dim, kPad);
  g.tile_pos = std::clamp<int64_t>(kTileRows / g.group, 1, std::max<int64_t>(s.seq_q, 1));
  g.rows = round_up(g.tile_pos * g.group, kPad);
  g.n_tiles = (s.seq_q + g.tile_pos - 1) / g.tile_pos;
  g.kv_rstride = s.kv_heads * s.head_dim;
  g.kv_bstride = s.kv_batch_stride ? s.kv_batch_stride : s.seq_kv * g.kv_rstride;
  WL_CHECK_GE(g.kv_bstride, s.seq_kv * g.kv_rstride);
  g.score_scale = kLog2e / std::sqrt(float(s.head_dim));
  return g;
}

// One tile: rows r < positions * group are query position t0 + r / group of head
// kv_head * group + r % group; the rows after that are padding.
struct Tile {
  int64_t b = 0, kv_head = 0, t0 = 0, positions = 0;
  int64_t kv_end = 0;   // keys [0, kv_end) are visible to some row
  int64_t kv_full = 0;  // keys [0, kv_full) are visible to every row
};

Tile make_tile(const Geometry& g, int64_t b, int64_t kv_head, int64_t index) {
  Tile t;
  t.b = b;
  t.kv_head = kv_head;
  t.t0 = index * g.tile_pos;
  t.positions = std::min(g.tile_pos, g.s.seq_q - t.t0);
  t.kv_end = g.s.q_offset + t.t0 + t.positions;
  t.kv_full = g.s.q_offset + t.t0 + 1;
  return t;
}

// Offset of tile row r in q, out, dout, dq ([batch, seq_q, heads, head_dim]).
int64_t row_offset(const Geometry& g, const Tile& t, int64_t r) {
  const int64_t pos = t.t0 + r / g.group, head = t.kv_head * g.group + r % g.group;
  return ((t.b * g.s.seq_q + pos) * g.s.heads + head) * g.s.head_dim;
}

// Offset of tile row r in lse ([batch, heads, seq_q]).
int64_t lse_offset(const Geometry& g, const Tile& t, int64_t r) {
  const int64_t pos = t.t0 + r / g.group, head = t.kv_head * g.group + r % g.group;
  return (t.b * g.s.heads + head) * g.s.seq_q + pos;
}

// Per-thread scratch, kept across calls (the OpenMP threads persist) and carved into `pieces`
// 64-byte aligned pieces of `floats` floats in all.
class Scratch {
 public:
  Scratch(int64_t floats, int64_t pieces) {
    thread_local std::vector<float> buf;
    const int64_t need = floats + 16 * (pieces + 1);  // each piece rounds up to 16 floats
    if (int64_t(buf.size()) < need) buf.resize(size_t(need));
    const auto addr = reinterpret_cast<uintptr_t>(buf.data());
    next_ = buf.data() + (64 - addr % 64) % 64 / sizeof(float);
    end_ = buf.data() + need;
  }
  float* take(int64_t floats) {
    float* p = next_;
    next_ += round_up(floats, 16);
    WL_CHECK(next_ <= end_) << "scratch overrun by " << next_ - end_ << " floats";
    return p;
  }

 private:
  float* next_ = nullptr;
  float* end_ = nullptr;
};

// A block of keys/values as tile_gemm reads them: in place when head_dim is a multiple of 8,
// else copied into zero-padded [nk, dp] buffers so that 8-wide loads stay inside each row.
struct KvBlock {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ld = 0;
};

// k and v: the block's first key and value of the tile's kv head.
WL_ALWAYS_INLINE KvBlock kv_block(const Geometry& g, const float* k, const float* v, int64_t nk,
                                  float* k_pad, float* v_pad) {
  if (g.dp == g.s.head_dim) return {k, v, g.kv_rstride};
  for (int64_t j = 0; j < nk; ++j) {
    const float* ks = k + j * g.kv_rstride;
    const float* vs = v + j * g.kv_rstride;
    for (int64_t d = 0; d < g.dp; ++d) {
      k_pad[j * g.dp + d] = d < g.s.head_dim ? ks[d] : 0.0f;
      v_pad[j * g.dp + d] = d < g.s.head_dim ? vs[d] : 0.0f;
    }
  }
  return {k_pad, v_pad, g.dp};
}

// Offset of key j0 of the tile's kv head in k and v laid out as [batch, seq_kv, kv_heads, dh].
int64_t key_offset(const Geometry& g, const Tile& t, int64_t j0) {
  return t.b * g.kv_bstride + j0 * g.kv_rstride + t.kv_head * g.s.head_dim;
}

// The key block that starts at key j0: at most kKeyBlock keys, and (paged) none past the end
// of the segment holding j0. `seg` and `seg_first` (that segment and its first key) move on
// as j0 grows.
WL_ALWAYS_INLINE KvBlock next_block(const Geometry& g, const Tile& t, const float* k,
                                    const float* v, int64_t j0, int64_t& nk, size_t& seg,
                                    int64_t& seg_first, float* k_pad, float* v_pad) {
  nk = std::min(kKeyBlock, t.kv_end - j0);
  if (g.segments.empty()) {
    const int64_t off = key_offset(g, t, j0);
    return kv_block(g, k + off, v + off, nk, k_pad, v_pad);
  }
  while (j0 >= seg_first + g.segments[seg].tokens) seg_first += g.segments[seg++].tokens;
  const KvSegment& s = g.segments[seg];
  nk = std::min(nk, seg_first + s.tokens - j0);
  const int64_t off = (j0 - seg_first) * g.kv_rstride + t.kv_head * g.s.head_dim;
  return kv_block(g, s.k + off, s.v + off, nk, k_pad, v_pad);
}

// Copies tile rows into `dst` transposed ([dp, rows], times `scale`) and/or row-major
// ([rows, dp]); padding rows and columns are zero.
WL_ALWAYS_INLINE void pack_rows(const Geometry& g, const Tile& t, const float* src, float scale,
                                float* transposed, float* row_major) {
  const int64_t valid = t.positions * g.group, hd = g.s.head_dim;
  for (int64_t r = 0; r < g.rows; ++r) {
    const float* s = r < valid ? src + row_offset(g, t, r) : nullptr;
    for (int64_t d = 0; d < g.dp; ++d) {
      const float x = s && d < hd ? s[d] : 0.0f;
      if (transposed) transposed[d * g.rows + r] = x * scale;
      if (row_major) row_major[r * g.dp + d] = x;
    }
  }
}

// Key-count limit per row, as float for the vector compare: row r sees keys < klim[r]. Padding
// rows see the whole visited range so they never force masking.
WL_ALWAYS_INLINE void fill_key_limits(const Geometry& g, const Tile& t, float* klim) {
  const int64_t valid = t.positions * g.group;
  for (int64_t r = 0; r < g.rows; ++r)
    klim[r] = float(r < valid ? g.s.q_offset + t.t0 + r / g.group + 1 : t.kv_end);
}

// S^T[nk, rows] = K_blk[nk, head_dim] . Q^T[head_dim, rows], then -inf where key >= klim[row].
template <int W>
WL_ALWAYS_INLINE void block_scores(const Geometry& g, const Tile& t, const KvBlock& kb,
                                   const float* qt, const float* klim, int64_t j0, int64_t nk,
                                   float* st) {
  detail::tile_gemm<W>({.m = nk,
                        .n = g.rows,
                        .k = g.s.head_dim,
                        .a = kb.k,
                        .a_row_stride = kb.ld,
                        .a_k_stride = 1,
                        .b = qt,
                        .ldb = g.rows,
                        .c = st,
                        .ldc = g.rows});
  if (j0 + nk <= t.kv_full) return;
  const F32v<W> neg_inf = splat_v<W>(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nk; ++j) {
    const F32v<W> key = splat_v<W>(float(j0 + j));
    for (int64_t c = 0; c < g.rows; c += W) {
      float* p = st + j * g.rows + c;
      store_v<W>(p, key >= load_v<W>(klim + c) ? neg_inf : load_v<W>(p));
    }
  }
}

template <int W>
WL_ALWAYS_INLINE void forward_tile_impl(const Geometry& g, const float* q, const float* k,
                                        const float* v, float* out, float* lse, int64_t unit) {
  // Units run the most expensive (last) query tiles first, so the cheap ones fill in at the end.
  const int64_t bk = unit % (g.s.batch * g.s.kv_heads);
  const Tile t = make_tile(g, bk / g.s.kv_heads, bk % g.s.kv_heads,
                           g.n_tiles - 1 - unit / (g.s.batch * g.s.kv_heads));
  const int64_t rows = g.rows, dp = g.dp;
  Scratch scratch(2 * dp * rows + kKeyBlock * rows + 4 * rows + 2 * kKeyBlock * dp, 9);
  float* qt = scratch.take(dp * rows);         // Q^T [dp, rows], pre-scaled
  float* st = scratch.take(kKeyBlock * rows);  // S^T, then P^T, [nk, rows]
  float* o = scratch.take(rows * dp);          // unnormalised output [rows, dp]
  float* m = scratch.take(rows);               // running max, base-2 units
  float* l = scratch.take(rows);               // running sum of 2^(s - m)
  float* alpha = scratch.take(rows);           // 2^(m_old - m_new) of the current block
  float* klim = scratch.take(rows);
  float* k_pad = scratch.take(kKeyBlock * dp);
  float* v_pad = scratch.take(kKeyBlock * dp);

  pack_rows(g, t, q, g.score_scale, qt, nullptr);
  fill_key_limits(g, t, klim);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
  std::fill(o, o + rows * dp, 0.0f);

  size_t seg = 0;
  int64_t seg_first = 0, nk = 0;
  for (int64_t j0 = 0; j0 < t.kv_end; j0 += nk) {
    const KvBlock kb = next_block(g, t, k, v, j0, nk, seg, seg_first, k_pad, v_pad);
    block_scores<W>(g, t, kb, qt, klim, j0, nk, st);
    // Online softmax down the columns of S^T. Every row sees key 0, so m is finite after the
    // first block and alpha = 2^(-inf) = 0 there.
    for (int64_t c = 0; c < rows; c += W) {
      const F32v<W> m_old = load_v<W>(m + c);
      F32v<W> m_new = m_old;
      for (int64_t j = 0; j < nk; ++j) m_new = detail::max_v(m_new, load_v<W>(st + j * rows + c));
      F32v<W> sum{};
      for (int64_t j = 0; j < nk; ++j) {
        const F32v<W> p = detail::exp2_v(load_v<W>(st + j * rows + c) - m_new);
        store_v<W>(st + j * rows + c, p);
        sum += p;
      }
      const F32v<W> a = detail::exp2_v(m_old - m_new);
      store_v<W>(l + c, load_v<W>(l + c) * a + sum);
      store_v<W>(m + c, m_new);
      store_v<W>(alpha + c, a);
    }
    if (j0 > 0) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dp; d += W)
          store_v<W>(o + r * dp + d, load_v<W>(o + r * dp + d) * alpha[r]);
    }
    // O[rows, dp] += P[rows, nk] . V_blk[nk, dp]; P(r, j) is st[j * rows + r].
    detail::tile_gemm<W>({.m = rows,
                          .n = dp,
                          .k = nk,
                          .a = st,
                          .a_row_stride = 1,
                          .a_k_stride = rows,
                          .b = kb.v,
                          .ldb = kb.ld,
                          .c = o,
                          .ldc = dp,
                          .accumulate = true});
  }

  const int64_t valid = t.positions * g.group;
  for (int64_t r = 0; r < valid; ++r) {
    const float inv = 1.0f / l[r];
    float* dst = out + row_offset(g, t, r);
    for (int64_t d = 0; d < g.s.head_dim; ++d) dst[d] = o[r * dp + d] * inv;
    if (lse) lse[lse_offset(g, t, r)] = (m[r] + std::log2(l[r])) * kLn2;
  }
}

// The chunk a query tile belongs to, dealing tiles out in snake order (0 1 2 2 1 0 0 1 ...).
int64_t chunk_of_tile(int64_t tile, int64_t chunks) {
  const int64_t p = tile % (2 * chunks);
  return p < chunks ? p : 2 * chunks - 1 - p;
}

struct BackwardArgs {
  const float *q, *k, *v, *out, *lse, *dout;
  float* dq;
  float* partials;  // [batch, kv_heads, chunks, 2 (dk, dv), seq_kv, dp]
  int64_t chunks;
};

// One backward unit's scratch: a query tile's packed operands and one key block's scores.
struct BackwardScratch {
  explicit BackwardScratch(const Geometry& g)
      : buf(5 * g.dp * g.rows + 2 * kKeyBlock * g.rows + 3 * g.rows + 2 * kKeyBlock * g.dp, 12) {
    const int64_t rows = g.rows, dp = g.dp;
    qt = buf.take(dp * rows);
    qn = buf.take(rows * dp);
    dot = buf.take(dp * rows);
    don = buf.take(rows * dp);
    dqt = buf.take(rows * dp);
    st = buf.take(kKeyBlock * rows);
    dst = buf.take(kKeyBlock * rows);
    lse2 = buf.take(rows);
    dvec = buf.take(rows);
    klim = buf.take(rows);
    k_pad = buf.take(kKeyBlock * dp);
    v_pad = buf.take(kKeyBlock * dp);
  }
  Scratch buf;
  float* qt;    // Q^T [dp, rows], pre-scaled to base-2 units
  float* qn;    // Q [rows, dp], unscaled
  float* dot;   // dO^T [dp, rows]
  float* don;   // dO [rows, dp]
  float* dqt;   // dQ of the tile [rows, dp], unscaled
  float* st;    // S^T then P^T [nk, rows]
  float* dst;   // dP^T then dS^T [nk, rows]
  float* lse2;  // lse in base-2 units [rows]
  float* dvec;  // D = rowsum(dO * O) [rows]
  float* klim;  // per row, the first key it may not see
  float* k_pad;
  float* v_pad;
};

// Packs a tile's Q and dO, and computes D and lse in base 2; zeroes the tile's dQ.
template <int W>
WL_ALWAYS_INLINE void begin_backward_tile(const Geometry& g, const BackwardArgs& args,
                                          const Tile& t, BackwardScratch& b) {
  const int64_t rows = g.rows, dp = g.dp, hd = g.s.head_dim;
  const int64_t valid = t.positions * g.group;
  pack_rows(g, t, args.q, g.score_scale, b.qt, b.qn);
  pack_rows(g, t, args.dout, 1.0f, b.dot, b.don);
  fill_key_limits(g, t, b.klim);
  for (int64_t r = 0; r < rows; ++r) {
    float dsum = 0.0f;
    if (r < valid) {
      const float* o = args.out + row_offset(g, t, r);
      for (int64_t d = 0; d < hd; ++d) dsum += o[d] * b.don[r * dp + d];
    }
    b.dvec[r] = dsum;
    b.lse2[r] = r < valid ? args.lse[lse_offset(g, t, r)] * kLog2e : 0.0f;
  }
  std::fill(b.dqt, b.dqt + rows * dp, 0.0f);
}

// The five tile GEMMs of one key block [j0, j0 + nk): P and dS recomputed, then dV, dK (into
// the unit's partials pdk / pdv, [seq_kv, dp]) and the tile's dQ accumulated.
template <int W>
WL_ALWAYS_INLINE void backward_key_block(const Geometry& g, const BackwardArgs& args, const Tile& t,
                                         BackwardScratch& b, int64_t j0, float* pdk, float* pdv) {
  const int64_t rows = g.rows, dp = g.dp, hd = g.s.head_dim;
  const int64_t valid = t.positions * g.group;
  const int64_t nk = std::min(kKeyBlock, t.kv_end - j0);
  const int64_t off = key_offset(g, t, j0);
  const KvBlock kb = kv_block(g, args.k + off, args.v + off, nk, b.k_pad, b.v_pad);
  block_scores<W>(g, t, kb, b.qt, b.klim, j0, nk, b.st);
  // dP^T[nk, rows] = V_blk[nk, head_dim] . dO^T[head_dim, rows]
  detail::tile_gemm<W>({.m = nk,
                        .n = rows,
                        .k = hd,
                        .a = kb.v,
                        .a_row_stride = kb.ld,
                        .a_k_stride = 1,
                        .b = b.dot,
                        .ldb = rows,
                        .c = b.dst,
                        .ldc = rows});
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t c = 0; c < rows; c += W) {
      float* ps = b.st + j * rows + c;
      float* pd = b.dst + j * rows + c;
      const F32v<W> p = detail::exp2_v(load_v<W>(ps) - load_v<W>(b.lse2 + c));
      store_v<W>(ps, p);
      store_v<W>(pd, p * (load_v<W>(pd) - load_v<W>(b.dvec + c)));
    }
  }
  // dV_blk += P^T . dO and dK_blk += dS^T . Q over the tile's real rows; padding rows have
  // dO = 0 and hence dS = 0, so they would add nothing.
  detail::tile_gemm<W>({.m = nk,
                        .n = dp,
                        .k = valid,
                        .a = b.st,
                        .a_row_stride = rows,
                        .a_k_stride = 1,
                        .b = b.don,
                        .ldb = dp,
                        .c = pdv + j0 * dp,
                        .ldc = dp,
                        .accumulate = true});
  detail::tile_gemm<W>({.m = nk,
                        .n = dp,
                        .k = valid,
                        .a = b.dst,
                        .a_row_stride = rows,
                        .a_k_stride = 1,
                        .b = b.qn,
                        .ldb = dp,
                        .c = pdk + j0 * dp,
                        .ldc = dp,
                        .accumulate = true});
  // dQ[rows, dp] += dS[rows, nk] . K_blk[nk, dp], for the real rows only
  detail::tile_gemm<W>({.m = valid,
                        .n = dp,
                        .k = nk,
                        .a = b.dst,
                        .a_row_stride = 1,
                        .a_k_stride = rows,
                        .b = kb.k,
                        .ldb = kb.ld,
                        .c = b.dqt,
                        .ldc = dp,
                        .accumulate = true});
}

template <int W>
WL_ALWAYS_INLINE void backward_unit_impl(const Geometry& g, const BackwardArgs& args,
                                         int64_t unit) {
  const int64_t dp = g.dp, hd = g.s.head_dim, seq_kv = g.s.seq_kv;
  const int64_t chunk = unit % args.chunks, bk = unit / args.chunks;
  float* pdk = args.partials + unit * 2 * seq_kv * dp;  // [seq_kv, dp]
  float* pdv = pdk + seq_kv * dp;
  std::fill(pdk, pdk + 2 * seq_kv * dp, 0.0f);
  BackwardScratch b(g);
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int64_t index = 0; index < g.n_tiles; ++index) {
    if (chunk_of_tile(index, args.chunks) != chunk) continue;
    const Tile t = make_tile(g, bk / g.s.kv_heads, bk % g.s.kv_heads, index);
    begin_backward_tile<W>(g, args, t, b);
    for (int64_t j0 = 0; j0 < t.kv_end; j0 += kKeyBlock) {
      backward_key_block<W>(g, args, t, b, j0, pdk, pdv);
    }
    for (int64_t r = 0; r < t.positions * g.group; ++r) {
      float* dq = args.dq + row_offset(g, t, r);
      for (int64_t d = 0; d < hd; ++d) dq[d] = b.dqt[r * dp + d] * scale;
    }
  }
}

// The entry points, one version per ISA (see detail/simd.h), picked at load time.
#if WL_FMV
WL_TARGET_V3 void forward_tile(const Geometry& g, const float* q, const float* k, const float* v,
                               float* out, float* lse, int64_t unit) {
  forward_tile_impl<8>(g, q, k, v, out, lse, unit);
}
WL_TARGET_V3 void backward_unit(const Geometry& g, const BackwardArgs& args, int64_t unit) {
  backward_unit_impl<8>(g, args, unit);
}
#endif
WL_TARGET_BASELINE void forward_tile(const Geometry& g, const float* q, const float* k,
                                     const float* v, float* out, float* lse, int64_t unit) {
  forward_tile_impl<4>(g, q, k, v, out, lse, unit);
}
WL_TARGET_BASELINE void backward_unit(const Geometry& g, const BackwardArgs& args, int64_t unit) {
  backward_unit_impl<4>(g, args, unit);
}

}  // namespace

void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse) {
  const Geometry g = make_geometry(s);
  if (s.batch == 0 || s.seq_q == 0) return;
  parallel_for_each(s.batch * s.kv_heads * g.n_tiles,
                    [&](int64_t unit) { forward_tile(g, q, k, v, out, lse, unit); });
}

void attention_forward_paged(const AttentionShape& s, const float* q, std::span<const KvSegment> kv,
                             float* out, float* lse) {
  WL_CHECK_EQ(s.batch, 1) << "paged attention runs one batch row";
  Geometry g = make_geometry(s);
  int64_t held = 0;
  for (const KvSegment& seg : kv) held += seg.tokens;
  WL_CHECK_GE(held, s.seq_kv) << "the segments hold fewer keys than seq_kv";
  g.segments = kv;
  if (s.seq_q == 0) return;
  parallel_for_each(s.kv_heads * g.n_tiles,
                    [&](int64_t unit) { forward_tile(g, q, nullptr, nullptr, out, lse, unit); });
}

void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv) {
  const Geometry g = make_geometry(s);
  const int64_t hd = s.head_dim, dense = s.batch * s.seq_kv * s.kv_heads * hd;
  std::fill(dk, dk + dense, 0.0f);
  std::fill(dv, dv + dense, 0.0f);
  if (s.batch == 0 || s.seq_q == 0) return;
  WL_CHECK(lse != nullptr) << "attention_backward needs the lse saved by the forward pass";

  const int64_t bk = s.batch * s.kv_heads;
  const int64_t chunks = std::clamp<int64_t>((kBackwardUnits + bk - 1) / bk, 1, g.n_tiles);
  // Kept across calls by the calling thread: 1 MiB for the small preset, re-faulting it each
  // step would cost more than the reduction below.
  thread_local std::vector<float> partials;
  const int64_t part_size = bk * chunks * 2 * s.seq_kv * g.dp;
  if (int64_t(partials.size()) < part_size) partials.resize(size_t(part_size));
  const BackwardArgs args{q, k, v, out, lse, dout, dq, partials.data(), chunks};
  parallel_for_each(bk * chunks, [&](int64_t unit) { backward_unit(g, args, unit); });

  // dk, dv = sum over chunks in chunk order; dk also takes the 1/sqrt(head_dim) of the scores.
  const float scale = 1.0f / std::sqrt(float(hd));
  const float* part = partials.data();
  parallel_for(s.batch * s.seq_kv, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / s.seq_kv, pos = i % s.seq_kv;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        float* dkr = dk + (i * s.kv_heads + h) * hd;
        float* dvr = dv + (i * s.kv_heads + h) * hd;
        for (int64_t c = 0; c < chunks; ++c) {
          const float* pk =
              part + (((b * s.kv_heads + h) * chunks + c) * 2 * s.seq_kv + pos) * g.dp;
          const float* pv = pk + s.seq_kv * g.dp;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) {
            dkr[d] += pk[d];
            dvr[d] += pv[d];
          }
        }
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) dkr[d] *= scale;
      }
    }
  });
}

void attention_forward_reference(const AttentionShape& s, const float* q, const float* k,
                                 const float* v, float* out) {
  const Geometry g = make_geometry(s);
  const int64_t hd = s.head_dim;
  const double scale = 1.0 / std::sqrt(double(hd));
  std::vector<double> scores(size_t(s.seq_kv));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.seq_q; ++t)
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t kvh = h / g.group, visible = s.q_offset + t + 1;
        const float* qr = q + ((b * s.seq_q + t) * s.heads + h) * hd;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          const float* kr = k + b * g.kv_bstride + j * g.kv_rstride + kvh * hd;
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += double(qr[d]) * kr[d];
          scores[size_t(j)] = dot * scale;
          mx = std::max(mx, scores[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < visible; ++j) {
          scores[size_t(j)] = std::exp(scores[size_t(j)] - mx);
          sum += scores[size_t(j)];
        }
        float* o = out + ((b * s.seq_q + t) * s.heads + h) * hd;
        for (int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < visible; ++j)
            acc += scores[size_t(j)] * v[b * g.kv_bstride + j * g.kv_rstride + kvh * hd + d];
          o[d] = float(acc / sum);
        }
      }
}

}  // namespace wl::kernels
