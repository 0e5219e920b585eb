/* C[m, n] = alpha * op(A) @ op(B) + beta * C, row-major, on oneDNN.
 *
 * Two oneDNN entry points can do this, and the choice was measured on this project's machines
 * (2-core AMD EPYC, AVX2+FMA, oneDNN 2.6.3 from Debian, OpenMP runtime):
 *
 *   - dnnl_sgemm, the BLAS-like call: f32 only, alpha/beta/transposes/leading dimensions
 *     as arguments, nothing to create or cache.
 *   - the matmul primitive: any dtype oneDNN supports, but a primitive per shape (about
 *     50-200 us to create) and a few memory objects per call.
 *
 * Without AVX-512 both run the same "gemm:jit" kernels, so large shapes are equal to within
 * noise (about 160 GFLOP/s on 2 threads for [2048x256]x[256x1024]); on small ones sgemm wins
 * by the per-call overhead (16x16x16: 0.7 us against 3.2 us; 1x1024x256: 12.7 against
 * 15.4 us). Our MoE experts see a different row count every step, so a per-shape primitive
 * would also be created over and over. So f32 goes through dnnl_sgemm.
 *
 * bf16 needs the primitive. oneDNN 2.6 builds a bf16 matmul only where the CPU has
 * AVX-512 (core or better); elsewhere creation throws. gemm_bf16_is_native() tries once; when
 * it fails, bf16 operands are widened to f32 in a thread-local scratch buffer (exact: a bf16 is
 * the top half of an f32) and multiplied by sgemm. The O(mk + kn) widening is small next to
 * the O(mnk) product for every shape we run.
 *
 * The primitive path keeps its primitives in a cache keyed by everything the primitive bakes
 * in (shape, transposes, leading dimensions, dtype, alpha, beta). Transposes and leading
 * dimensions are strided memory descriptors, so no operand is copied (except on AMX, below
 * dense_matmul_tile); alpha is an output scale and beta a sum post-op
 * (dst = alpha * A@B + beta * dst_before). The scratchpad is
 * user-managed and thread-local, so one cached primitive may run on several threads at once.
 *
 * Threads. oneDNN is an OpenMP build, and its GEMMs split C in fixed shares between the
 * threads of an OpenMP team and meet at a barrier: when another process takes one of our cores,
 * every GEMM waits for the thread that lost it (a busy neighbour made our training step 3x
 * slower). So we cut C into tiles ourselves and run them on core/parallel.h's pool, each tile
 * one single-threaded oneDNN call (every thread that calls oneDNN sets OpenMP to one thread,
 * so no team is ever formed), and a slowed thread just runs fewer tiles. Tiles cut C, never k,
 * so each element is one sum in oneDNN's order and a product is bitwise the same for any
 * --threads.
 *
 * Errors from oneDNN mean we passed a bad shape or pointer: a check failure naming the shape.
 */
#include "weightlift/kernels/gemm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "weightlift/core/aligned.h"
#include "weightlift/core/check.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/mutex.h"
#include "weightlift/core/parallel.h"

namespace wl::kernels {
namespace detail {
// Runs the matmul-primitive path for any dtype. gemm() uses it for native bf16 only; the tests
// call it directly (tests/kernels/gemm_test.cc declares it) so that the path is checked on
// machines where f32 goes through sgemm and bf16 is not native.
void gemm_with_matmul_primitive(const GemmArgs& args);
// The same, with every tile multiplying dense copies of its operands, as bf16 tiles do on AMX:
// the tests run it on every CPU (f32) so that the copies are checked where there is no AMX.
void gemm_with_dense_tiles(const GemmArgs& args);
}  // namespace detail

namespace {

std::string describe(const GemmArgs& g) {
  std::ostringstream os;
  os << "gemm m=" << g.m << " n=" << g.n << " k=" << g.k << " trans_a=" << g.trans_a
     << " lda=" << g.lda << " trans_b=" << g.trans_b << " ldb=" << g.ldb << " ldc=" << g.ldc
     << " alpha=" << g.alpha << " beta=" << g.beta << " in_type=" << dtype_name(g.in_type);
  return os.str();
}

void validate(const GemmArgs& g) {
  WL_CHECK(g.m >= 0 && g.n >= 0 && g.k >= 0) << describe(g);
  WL_CHECK(g.in_type == DType::kF32 || g.in_type == DType::kBF16) << describe(g);
  // An empty C (an expert that got no tokens) is nothing to do, whatever the strides say.
  if (g.m == 0 || g.n == 0) return;
  // Row-major: a leading dimension is at least the stored row length, and at least 1.
  WL_CHECK(g.c != nullptr && g.ldc >= std::max<int64_t>(1, g.n)) << describe(g);
  if (g.k == 0) return;  // A and B are empty: only C is touched
  const int64_t a_cols = g.trans_a ? g.m : g.k, b_cols = g.trans_b ? g.k : g.n;
  WL_CHECK(g.a != nullptr && g.lda >= std::max<int64_t>(1, a_cols)) << describe(g);
  WL_CHECK(g.b != nullptr && g.ldb >= std::max<int64_t>(1, b_cols)) << describe(g);
}

// k == 0: the product is empty, so C = beta * C (and beta == 0 must not read C).
void scale_c(const GemmArgs& g) {
  for (int64_t i = 0; i < g.m; ++i) {
    float* row = g.c + i * g.ldc;
    if (g.beta == 0.0f) {
      std::memset(row, 0, size_t(g.n) * sizeof(float));
    } else {
      for (int64_t j = 0; j < g.n; ++j) row[j] *= g.beta;
    }
  }
}

// One tile in f32, on this thread.
void sgemm_tile(const GemmArgs& g) {
  const dnnl_status_t st = dnnl_sgemm(g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', g.m, g.n, g.k,
                                      g.alpha, static_cast<const float*>(g.a), g.lda,
                                      static_cast<const float*>(g.b), g.ldb, g.beta, g.c, g.ldc);
  WL_CHECK_EQ(int(st), int(dnnl_success)) << "dnnl_sgemm failed: " << describe(g);
}

// Widens a bf16 matrix of `rows` rows, `cols` used columns and leading dimension `ld` into a
// dense f32 matrix (leading dimension `cols`).
void widen_bf16(const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, cols));
  parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      convert_bf16_to_f32(src + r * ld, dst + r * cols, size_t(cols));
    }
  });
}

// bf16 without native support: widen both operands, then the f32 path. Thread-local scratch
// so concurrent callers (e.g. ranks running as threads) do not share it.
void gemm_bf16_via_f32(const GemmArgs& g);

// ---- tiles -----------------------------------------------------------------------------------

// What a product costs, in FLOP-equivalents: its FLOPs plus the bytes it streams, a byte
// counted as kFlopsPerByte FLOPs (one core multiplies about that much faster than it reads
// memory here). A decode step's products (a few rows against a weight matrix) are all bytes.
// Below kTileWork a product is one tile: about 100 us of one core, next to a few us of
// oneDNN's set-up per call. kMaxTiles bounds the operand re-reads of the cut.
constexpr double kFlopsPerByte = 8;
constexpr double kTileWork = double(int64_t(1) << 21);
constexpr int64_t kMaxTiles = 8;
// Start of piece i of t along a side of `len`, aligned down to `align` (the last piece ends at
// len).
int64_t cut(int64_t i, int64_t t, int64_t len, int64_t align) {
  if (i >= t) return len;
  return std::min(len, (len * i / t) / align * align);
}

struct TileGrid {
  int64_t tm = 1, tn = 1;  // pieces along m and along n
  // Tile sides stay multiples of these where the matrix is larger: the vector width and
  // oneDNN's register blocking; and, with B transposed (every forward Linear, x W^T), at
  // least 64 rows and 128 columns. oneDNN's sgemm runs B^T tiles of 64 columns or 32 rows at
  // half the rate of B tiles, or worse (docs/BENCHMARKS.md, "GEMM tiles with B transposed").
  int64_t row_align = 8, col_align = 64;
};

// A tm x tn grid re-reads A tn times and B tm times: k (tn m + tm n) elements, least when
// tm / tn = m / n. So the grid follows C's aspect, within the tile budget and the alignments.
TileGrid tile_grid(const GemmArgs& g) {
  const double elem = g.in_type == DType::kBF16 ? 2 : 4;
  const double m = double(g.m), n = double(g.n), k = double(g.k);
  const double work = 2 * m * n * k + kFlopsPerByte * (elem * (m * k + k * n) + 4 * m * n);
  const int64_t tiles = std::clamp<int64_t>(int64_t(work / kTileWork), 1, kMaxTiles);
  TileGrid t;
  if (g.trans_b) {
    t.row_align = 64;
    t.col_align = 128;
  }
  const int64_t m_max = std::max<int64_t>(1, g.m / t.row_align);
  const int64_t n_max = std::max<int64_t>(1, g.n / t.col_align);
  const double tm = std::sqrt(double(tiles) * double(g.m) / double(g.n));
  t.tm = std::clamp<int64_t>(int64_t(std::lround(tm)), 1, std::min(tiles, m_max));
  t.tn = std::clamp<int64_t>(tiles / t.tm, 1, n_max);
  return t;
}

// The product restricted to C's rows [m0, m1) and columns [n0, n1): the same operands, offset.
GemmArgs sub_gemm(const GemmArgs& g, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const size_t elem = g.in_type == DType::kBF16 ? 2 : 4;
  auto at = [elem](const void* p, int64_t elements) {
    return static_cast<const char*>(p) + size_t(elements) * elem;
  };
  GemmArgs s = g;
  s.m = m1 - m0;
  s.n = n1 - n0;
  s.a = at(g.a, g.trans_a ? m0 : m0 * g.lda);
  s.b = at(g.b, g.trans_b ? n0 * g.ldb : n0);
  s.c = g.c + m0 * g.ldc + n0;
  return s;
}

// oneDNN runs a call on the calling thread alone when OpenMP allows that thread one thread;
// the setting is per thread, so every thread that calls oneDNN makes it once.
void one_onednn_thread() {
  thread_local const bool set = [] {
    omp_set_num_threads(1);
    return true;
  }();
  (void)set;
}

// Runs tile(args) for each tile of g's C, on the pool.
template <class Fn>
void for_each_tile(const GemmArgs& g, const Fn& tile) {
  const TileGrid t = tile_grid(g);
  parallel_for_each(t.tm * t.tn, [&](int64_t i) {
    const int64_t im = i / t.tn, in = i % t.tn;
    one_onednn_thread();
    tile(sub_gemm(g, cut(im, t.tm, g.m, t.row_align), cut(im + 1, t.tm, g.m, t.row_align),
                  cut(in, t.tn, g.n, t.col_align), cut(in + 1, t.tn, g.n, t.col_align)));
  });
}

void gemm_bf16_via_f32(const GemmArgs& g) {
  thread_local std::vector<float> a32, b32;
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  a32.resize(size_t(a_rows * a_cols));
  b32.resize(size_t(b_rows * b_cols));
  widen_bf16(static_cast<const uint16_t*>(g.a), a_rows, a_cols, g.lda, a32.data());
  widen_bf16(static_cast<const uint16_t*>(g.b), b_rows, b_cols, g.ldb, b32.data());
  GemmArgs wide = g;
  wide.in_type = DType::kF32;
  wide.a = a32.data();
  wide.lda = a_cols;
  wide.b = b32.data();
  wide.ldb = b_cols;
  for_each_tile(wide, sgemm_tile);
}

// ---- the matmul-primitive path -------------------------------------------------------------

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::memory::data_type dnnl_type(DType t) {
  return t == DType::kBF16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
}

struct PrimitiveKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  DType in_type;
  uint32_t alpha_bits, beta_bits;  // bit patterns: exact, and NaN-safe as a key

  bool operator==(const PrimitiveKey&) const = default;
};

struct PrimitiveKeyHash {
  size_t operator()(const PrimitiveKey& k) const {
    uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 0x100000001b3ull; };
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc}) mix(uint64_t(v));
    mix(uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.in_type) << 2);
    mix(uint64_t(k.alpha_bits) << 32 | k.beta_bits);
    return size_t(h);
  }
};

struct CachedMatmul {
  dnnl::memory::desc a_md, b_md, c_md, scratch_md;
  dnnl::matmul primitive;
};

// Builds the primitive; throws dnnl::error when oneDNN cannot.
std::shared_ptr<const CachedMatmul> build_matmul(const GemmArgs& g) {
  using dims = dnnl::memory::dims;
  const auto dt = dnnl_type(g.in_type);
  auto out = std::make_shared<CachedMatmul>();
  // Strides, not copies: op(A)[i, p] lives at a[i*lda + p], or a[p*lda + i] when transposed.
  out->a_md = dnnl::memory::desc({g.m, g.k}, dt, g.trans_a ? dims{1, g.lda} : dims{g.lda, 1});
  out->b_md = dnnl::memory::desc({g.k, g.n}, dt, g.trans_b ? dims{1, g.ldb} : dims{g.ldb, 1});
  out->c_md = dnnl::memory::desc({g.m, g.n}, dnnl::memory::data_type::f32, dims{g.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (g.alpha != 1.0f) attr.set_output_scales(0, {g.alpha});
  if (g.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(g.beta);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(out->a_md, out->b_md, out->c_md), attr,
                                  cpu_engine());
  out->scratch_md = pd.scratchpad_desc();
  out->primitive = dnnl::matmul(pd);
  return out;
}

class MatmulCache {
 public:
  std::shared_ptr<const CachedMatmul> get(const GemmArgs& g) WL_EXCLUDES(mu_) {
    uint32_t alpha_bits, beta_bits;
    std::memcpy(&alpha_bits, &g.alpha, 4);
    std::memcpy(&beta_bits, &g.beta, 4);
    const PrimitiveKey key{g.m,       g.n,       g.k,       g.lda,      g.ldb,    g.ldc,
                           g.trans_a, g.trans_b, g.in_type, alpha_bits, beta_bits};
    MutexLock lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end()) return it->second;
    // Variable shapes (MoE row counts) would grow the cache without bound; dropping it all
    // now and then costs a few re-creations and keeps memory flat. Holders keep their entry.
    if (map_.size() >= kMaxEntries) map_.clear();
    std::shared_ptr<const CachedMatmul> built;
    try {
      built = build_matmul(g);
    } catch (const dnnl::error& e) {
      if (e.status == dnnl_out_of_memory) throw std::bad_alloc();  // docs/errors.md
      WL_CHECK(false) << "oneDNN cannot create a matmul for " << describe(g) << ": " << e.what();
    }
    map_.emplace(key, built);
    return built;
  }

 private:
  static constexpr size_t kMaxEntries = 4096;
  Mutex mu_;
  std::unordered_map<PrimitiveKey, std::shared_ptr<const CachedMatmul>, PrimitiveKeyHash> map_
      WL_GUARDED_BY(mu_);
};

MatmulCache& matmul_cache() {
  static MatmulCache cache;
  return cache;
}

// One tile through the cached primitive, on this thread.
void matmul_tile(const GemmArgs& g) {
  const std::shared_ptr<const CachedMatmul> mm = matmul_cache().get(g);
  thread_local std::vector<uint8_t> scratch;
  thread_local std::unique_ptr<dnnl::stream> stream;
  try {
    if (!stream) stream = std::make_unique<dnnl::stream>(cpu_engine());
    dnnl::engine& eng = cpu_engine();
    // oneDNN takes non-const handles but does not write to inputs.
    dnnl::memory a_mem(mm->a_md, eng, const_cast<void*>(g.a));
    dnnl::memory b_mem(mm->b_md, eng, const_cast<void*>(g.b));
    dnnl::memory c_mem(mm->c_md, eng, g.c);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
    const size_t scratch_bytes = mm->scratch_md.get_size();
    if (scratch_bytes > 0) {
      if (scratch.size() < scratch_bytes) scratch.resize(scratch_bytes);
      args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(mm->scratch_md, eng, scratch.data()));
    }
    mm->primitive.execute(*stream, args);
    stream->wait();
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_out_of_memory) throw std::bad_alloc();  // docs/errors.md
    WL_CHECK(false) << "oneDNN matmul failed for " << describe(g) << ": " << e.what();
  }
}

// oneDNN 2.6 runs its AMX kernels (brgemm) only on dense operands: a tile whose leading
// dimension is wider than the tile (every tile of a product cut along n) goes to gemm:jit,
// which on an AMX Xeon spends 1.45x the time in the `small` bf16 step's GEMMs
// (docs/BENCHMARKS.md, "bf16 on AMX"). So there the row tiles multiply dense copies of
// their strided operands: O(mk + kn + mn) copying in cache against O(mnk) products. Every
// tile of one size is the same dense primitive, so a row's bits still do not depend on the
// rows around it or the thread count. Products with A transposed (weight gradients) stay on
// the strided primitive: their k is an expert's token count, new every step, and creating an
// AMX primitive takes 3-26 ms against gemm:jit's 0.05.
struct DenseScratch {
  AlignedVector<char> a, b, c;
};

// Copies `rows` rows of `cols` elements of `elem` bytes, `ld` elements apart, into `dst` packed.
void* pack_rows(const void* src, int64_t rows, int64_t cols, int64_t ld, size_t elem,
                AlignedVector<char>& dst) {
  const size_t row_bytes = size_t(cols) * elem;
  dst.resize(size_t(rows) * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst.data() + size_t(r) * row_bytes,
                static_cast<const char*>(src) + size_t(r * ld) * elem, row_bytes);
  }
  return dst.data();
}

void dense_matmul_tile(const GemmArgs& g) {
  thread_local DenseScratch scratch;
  const size_t elem = g.in_type == DType::kBF16 ? 2 : 4;
  GemmArgs d = g;
  // A is stored [m, k] (or [k, m] when transposed); B [k, n] (or [n, k]); C [m, n].
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  if (g.lda != a_cols) {
    d.a = pack_rows(g.a, a_rows, a_cols, g.lda, elem, scratch.a);
    d.lda = a_cols;
  }
  if (g.ldb != b_cols) {
    d.b = pack_rows(g.b, b_rows, b_cols, g.ldb, elem, scratch.b);
    d.ldb = b_cols;
  }
  if (g.ldc == g.n) return matmul_tile(d);
  scratch.c.resize(size_t(g.m * g.n) * sizeof(float));
  d.c = reinterpret_cast<float*>(scratch.c.data());
  d.ldc = g.n;
  if (g.beta != 0.0f) pack_rows(g.c, g.m, g.n, g.ldc, sizeof(float), scratch.c);
  matmul_tile(d);
  for (int64_t r = 0; r < g.m; ++r) {
    std::memcpy(g.c + r * g.ldc, d.c + r * g.n, size_t(g.n) * sizeof(float));
  }
}

// Whether oneDNN will run AMX here: the CPU and the OS allow it (cpu_info) and oneDNN's own
// ISA limit (DNNL_MAX_CPU_ISA, or a build without AMX) does not stop short of it. The ISAs are
// bit sets, each containing the ones below it, so the test is a mask, not an order.
bool onednn_runs_amx() {
  const auto isa = unsigned(dnnl::get_effective_cpu_isa());
  const auto amx = unsigned(dnnl::cpu_isa::avx512_core_amx);
  return cpu_info().amx_bf16 && (isa & amx) == amx;
}

// A bf16 tile on this CPU's best path.
void bf16_tile(const GemmArgs& g) {
  static const bool amx = onednn_runs_amx();
  amx ? dense_matmul_tile(g) : matmul_tile(g);
}

// bf16 products whose rows are stored as rows (every product whose rows are tokens: a
// Linear's forward and its input gradient) run as tiles of exactly kBf16TileRows rows, cut
// along n by n alone, so that every tile of a column piece is the same cached primitive; the
// last tile's rows are padded with zeros in a scratch copy. oneDNN's bf16 kernels choose their
// blocking, and so the order of a dot product's sums, from the whole shape: without this a
// row's bits would depend on how many rows the product has (a data-parallel rank's half of the
// batch, an expert's share of the tokens), and a layout change would move the router's
// choices. Measured: one process against DDP 2 on `small`, an expert's gradient 13% apart.
constexpr int64_t kBf16TileRows = 64;
constexpr int64_t kBf16TileCols = 256;

void bf16_row_tiles(const GemmArgs& g) {
  const int64_t tm = (g.m + kBf16TileRows - 1) / kBf16TileRows;
  const int64_t tn = (g.n + kBf16TileCols - 1) / kBf16TileCols;
  parallel_for_each(tm * tn, [&](int64_t i) {
    const int64_t m0 = (i / tn) * kBf16TileRows, m1 = std::min(g.m, m0 + kBf16TileRows);
    const int64_t n0 = cut(i % tn, tn, g.n, 64), n1 = cut(i % tn + 1, tn, g.n, 64);
    one_onednn_thread();
    if (m1 - m0 == kBf16TileRows) return bf16_tile(sub_gemm(g, m0, m1, n0, n1));
    // The last rows, in a tile of the full height: A's rows and C's with their own strides,
    // so the tile is the same primitive as the others.
    thread_local std::vector<uint16_t> a;
    thread_local std::vector<float> c;
    a.resize(size_t(kBf16TileRows * g.lda));
    c.resize(size_t(kBf16TileRows * g.ldc));  // rows past the last are computed and dropped
    const auto* a_rows = static_cast<const uint16_t*>(g.a) + m0 * g.lda;
    std::memcpy(a.data(), a_rows, size_t(((m1 - m0 - 1) * g.lda + g.k) * 2));
    std::fill(a.begin() + (m1 - m0) * g.lda, a.end(), uint16_t(0));
    for (int64_t r = 0; g.beta != 0.0f && r < m1 - m0; ++r) {
      std::memcpy(&c[size_t(r * g.ldc + n0)], g.c + (m0 + r) * g.ldc + n0, size_t(n1 - n0) * 4);
    }
    GemmArgs padded = g;
    padded.a = a.data();
    padded.c = c.data();
    padded.m = kBf16TileRows;
    bf16_tile(sub_gemm(padded, 0, kBf16TileRows, n0, n1));
    for (int64_t r = 0; r < m1 - m0; ++r) {
      std::memcpy(g.c + (m0 + r) * g.ldc + n0, &c[size_t(r * g.ldc + n0)], size_t(n1 - n0) * 4);
    }
  });
}

}  // namespace

namespace detail {

void gemm_with_matmul_primitive(const GemmArgs& g) {
  validate(g);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) return scale_c(g);
  for_each_tile(g, matmul_tile);
}

void gemm_with_dense_tiles(const GemmArgs& g) {
  validate(g);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) return scale_c(g);
  for_each_tile(g, dense_matmul_tile);
}

}  // namespace detail

bool gemm_bf16_is_native() {
  static const bool native = [] {
    try {
      const dnnl::memory::desc ab({16, 16}, dnnl::memory::data_type::bf16,
                                  dnnl::memory::dims{16, 1});
      const dnnl::memory::desc c({16, 16}, dnnl::memory::data_type::f32, dnnl::memory::dims{16, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ab, ab, c), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return native;
}

void gemm(const GemmArgs& g) {
  validate(g);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) return scale_c(g);
  if (g.in_type == DType::kF32) {
    for_each_tile(g, sgemm_tile);
  } else if (gemm_bf16_is_native()) {
    g.trans_a ? for_each_tile(g, matmul_tile) : bf16_row_tiles(g);
  } else {
    gemm_bf16_via_f32(g);
  }
}

void gemm_reference(const GemmArgs& g) {
  validate(g);
  auto load = [&g](const void* p, int64_t i) -> double {
    return g.in_type == DType::kBF16 ? double(bf16_to_f32(static_cast<const uint16_t*>(p)[i]))
                                     : double(static_cast<const float*>(p)[i]);
  };
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        const double a = load(g.a, g.trans_a ? p * g.lda + i : i * g.lda + p);
        const double b = load(g.b, g.trans_b ? j * g.ldb + p : p * g.ldb + j);
        acc += a * b;
      }
      float& c = g.c[i * g.ldc + j];
      // beta == 0 overwrites: C may hold NaN, and 0 * NaN would leak it.
      c = float(double(g.alpha) * acc + (g.beta == 0.0f ? 0.0 : double(g.beta) * double(c)));
    }
  }
}

}  // namespace wl::kernels
