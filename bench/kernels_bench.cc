// The compute kernels timed one by one at the `small` preset's shapes (batch 8 x 256 tokens,
// d 256, ffn 512, 8 heads of 32, vocab 320): Google Benchmark runs each until its time is
// stable and reports the mean, with GFLOP/s or GB/s where they mean something. The context
// line names the CPU and the ISA the kernels dispatched to, and the compute threads.
//
//   build/release/bench/kernels_bench --benchmark_filter=Gemm
//   OMP_NUM_THREADS=1 build/release/bench/kernels_bench --benchmark_repetitions=5
//
// Correctness is the tests' job (tests/kernels/); nothing here checks results.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "weightlift/core/aligned.h"
#include "weightlift/core/cpu.h"
#include "weightlift/core/dtype.h"
#include "weightlift/core/parallel.h"
#include "weightlift/kernels/attention.h"
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/kernels/embedding.h"
#include "weightlift/kernels/fp8_quantize.h"
#include "weightlift/kernels/gemm.h"
#include "weightlift/kernels/optimizer.h"
#include "weightlift/kernels/swiglu.h"

namespace wl::kernels {
namespace {

std::vector<float> random_values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

std::vector<int64_t> random_tokens(size_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
  std::vector<int64_t> v(n);
  for (int64_t& t : v) t = dist(gen);
  return v;
}

// GEMM shapes of the small preset's step: (m, n, k, trans_a, trans_b).
void Gemm(benchmark::State& state, DType in_type) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool ta = state.range(3) != 0, tb = state.range(4) != 0;
  std::vector<float> a(size_t(m * k), 0.5f), b(size_t(k * n), 0.25f), c(size_t(m * n));
  std::vector<uint16_t> a16(a.size(), f32_to_bf16(0.5f)), b16(b.size(), f32_to_bf16(0.25f));
  const bool bf16 = in_type == DType::kBF16;
  const GemmArgs g{.m = m,
                   .n = n,
                   .k = k,
                   .a = bf16 ? static_cast<const void*>(a16.data()) : a.data(),
                   .lda = ta ? m : k,
                   .trans_a = ta,
                   .b = bf16 ? static_cast<const void*>(b16.data()) : b.data(),
                   .ldb = tb ? k : n,
                   .trans_b = tb,
                   .c = c.data(),
                   .ldc = n,
                   .in_type = in_type};
  for (auto _ : state) gemm(g);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(m) * double(n) * double(k),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
void GemmShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"m", "n", "k", "ta", "tb"});
  b->Args({2048, 256, 256, 0, 1});    // attention projections
  b->Args({2048, 1024, 256, 0, 1});   // gate/up of two experts' rows
  b->Args({512, 1024, 256, 0, 1});    // one expert's gate/up
  b->Args({64, 256, 512, 0, 1});      // one expert's down in a micro-batch of one row (PP)
  b->Args({320, 256, 2048, 1, 0});    // the head's weight gradient
  b->Args({2048, 256, 1024, 0, 0});   // down projection
  b->Args({2048, 2048, 2048, 0, 0});  // the peak measured in `bench train`
  b->Unit(benchmark::kMillisecond);
}
BENCHMARK_CAPTURE(Gemm, f32, DType::kF32)->Apply(GemmShapes);

// The rollout engine's decode GEMM (dequant_linear.cc): 64 rows against a widened band of 256
// weight rows of the small preset (d 256), the band `offset` floats past a cache line: 0, or
// 4, where a std::vector's large buffer lands (core/aligned.h).
void DecodeGemmBandOffset(benchmark::State& state) {
  const int64_t m = 64, n = 256, k = 256, offset = state.range(0);
  const std::vector<float> a = random_values(size_t(m * k), 1);
  AlignedVector<float> band(size_t(n * k + offset));
  const std::vector<float> w = random_values(size_t(n * k), 2);
  std::copy(w.begin(), w.end(), band.begin() + offset);
  std::vector<float> c(size_t(m * n));
  const GemmArgs g{.m = m,
                   .n = n,
                   .k = k,
                   .a = a.data(),
                   .lda = k,
                   .b = band.data() + offset,
                   .ldb = k,
                   .trans_b = true,
                   .c = c.data(),
                   .ldc = n};
  for (auto _ : state) gemm(g);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(m) * double(n) * double(k),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(DecodeGemmBandOffset)->Arg(0)->Arg(4)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Gemm, bf16, DType::kBF16)->Apply(GemmShapes);

// Causal attention of one training step: B 8, T 256, 8 heads sharing 1 kv head, head_dim 32.
// Forward 4 FLOPs per causal pair and head_dim, backward 10 (attention.cc).
void Attention(benchmark::State& state, bool backward) {
  const AttentionShape s{
      .batch = 8, .seq_q = 256, .seq_kv = 256, .heads = 8, .kv_heads = 1, .head_dim = 32};
  const size_t q = size_t(s.batch * s.seq_q * s.heads * s.head_dim);
  const size_t kv = size_t(s.batch * s.seq_kv * s.kv_heads * s.head_dim);
  const std::vector<float> qs = random_values(q, 1), ks = random_values(kv, 2),
                           vs = random_values(kv, 3), dout = random_values(q, 4);
  std::vector<float> out(q), lse(size_t(s.batch * s.heads * s.seq_q)), dq(q), dk(kv), dv(kv);
  attention_forward(s, qs.data(), ks.data(), vs.data(), out.data(), lse.data());
  for (auto _ : state) {
    if (backward) {
      attention_backward(s, qs.data(), ks.data(), vs.data(), out.data(), lse.data(), dout.data(),
                         dq.data(), dk.data(), dv.data());
    } else {
      attention_forward(s, qs.data(), ks.data(), vs.data(), out.data(), lse.data());
    }
  }
  const double pairs = double(s.batch * s.heads) * double(s.seq_q) * double(s.seq_q + 1) / 2;
  state.counters["GFLOP/s"] = benchmark::Counter((backward ? 10 : 4) * pairs * double(s.head_dim),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK_CAPTURE(Attention, forward, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Attention, backward, true)->Unit(benchmark::kMillisecond);

// One decode token of the small preset against 256 cached positions: the keys in one buffer,
// or in pages of `page` positions (the rollout engine's KV cache), each page its own buffer.
void DecodeAttention(benchmark::State& state) {
  const int64_t page = state.range(0);  // 0: one buffer
  const AttentionShape s{
      .batch = 1, .seq_q = 1, .seq_kv = 256, .heads = 8, .kv_heads = 1, .head_dim = 32};
  const int64_t row = s.kv_heads * s.head_dim;
  const std::vector<float> q = random_values(size_t(s.heads * s.head_dim), 1),
                           k = random_values(size_t(s.seq_kv * row), 2),
                           v = random_values(size_t(s.seq_kv * row), 3);
  std::vector<std::vector<float>> pages;
  std::vector<KvSegment> segments;
  for (int64_t first = 0; page > 0 && first < s.seq_kv; first += page) {
    const int64_t n = std::min(page, s.seq_kv - first);
    pages.emplace_back(k.begin() + first * row, k.begin() + (first + n) * row);
    pages.emplace_back(v.begin() + first * row, v.begin() + (first + n) * row);
    segments.push_back({pages[pages.size() - 2].data(), pages.back().data(), n});
  }
  std::vector<float> out(q.size());
  const AttentionShape decode{.batch = 1,
                              .seq_q = 1,
                              .seq_kv = s.seq_kv,
                              .heads = s.heads,
                              .kv_heads = s.kv_heads,
                              .head_dim = s.head_dim,
                              .q_offset = s.seq_kv - 1};
  for (auto _ : state) {
    if (page == 0) {
      attention_forward(decode, q.data(), k.data(), v.data(), out.data(), nullptr);
    } else {
      attention_forward_paged(decode, q.data(), segments, out.data(), nullptr);
    }
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(DecodeAttention)->Arg(0)->Arg(64)->Arg(32)->Arg(16)->Unit(benchmark::kMicrosecond);

// Cross-entropy with its gradient over 2048 tokens of vocab 320.
void CrossEntropy(benchmark::State& state) {
  const std::vector<float> logits = random_values(2048 * 320, 1);
  const std::vector<int64_t> targets = random_tokens(2048, 320, 2);
  std::vector<float> grad(logits.size());
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        cross_entropy(logits.data(), targets.data(), 2048, 320, grad.data(), 1.0f / 2048));
  }
}
BENCHMARK(CrossEntropy)->Unit(benchmark::kMicrosecond);

// The embedding lookup and its scatter-add gradient: 2048 tokens into a 320 x 256 table.
void Embedding(benchmark::State& state, bool backward) {
  const std::vector<int64_t> tokens = random_tokens(2048, 320, 1);
  const std::vector<float> table = random_values(320 * 256, 2), dout = random_values(2048 * 256, 3);
  std::vector<float> out(2048 * 256), dtable(320 * 256);
  for (auto _ : state) {
    if (backward) {
      embedding_backward(dout.data(), tokens.data(), dtable.data(), 2048, 320, 256);
    } else {
      embedding_forward(table.data(), tokens.data(), out.data(), 2048, 320, 256);
    }
  }
}
BENCHMARK_CAPTURE(Embedding, forward, false)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Embedding, backward, true)->Unit(benchmark::kMicrosecond);

// SwiGLU over the 4096 expert rows of one step (2048 tokens, top-2), ffn 512.
void Swiglu(benchmark::State& state, bool backward) {
  const std::vector<float> h = random_values(4096 * 1024, 1), dout = random_values(4096 * 512, 2);
  std::vector<float> out(4096 * 512), dh(h.size());
  for (auto _ : state) {
    if (backward) {
      swiglu_backward(h.data(), dout.data(), dh.data(), 4096, 512);
    } else {
      swiglu_forward(h.data(), out.data(), 4096, 512);
    }
  }
}
BENCHMARK_CAPTURE(Swiglu, forward, false)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Swiglu, backward, true)->Unit(benchmark::kMicrosecond);

// One AdamW step and the gradient norm's sum of squares over 20M parameters (about the small
// preset's count), with the bytes each moves: AdamW reads p, g, m, v and writes p, m, v. With
// the bf16 copy (a parameter server's shards, written as the step goes) it writes 2 bytes more
// per parameter; against a separate conversion afterwards (`Bf16Refresh`: the 4 bytes read
// again and the 2 written), the difference is what taking the refresh into the step saves.
void adamw(benchmark::State& state, bool copy) {
  const int64_t n = 20'000'000;
  std::vector<float> p = random_values(size_t(n), 1), m(size_t(n), 0.0f), v(size_t(n), 0.0f);
  const std::vector<float> g = random_values(size_t(n), 2, 0.1f);
  std::vector<uint16_t> bf16(copy ? size_t(n) : 0);
  int step = 0;
  for (auto _ : state) {
    adamw_step(p.data(), g.data(), m.data(), v.data(), n, {.step = ++step},
               copy ? bf16.data() : nullptr);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * n * (4 * 7 + (copy ? 2 : 0)));
}
void AdamW(benchmark::State& state) { adamw(state, false); }
void AdamWBf16Copy(benchmark::State& state) { adamw(state, true); }
BENCHMARK(AdamW)->Unit(benchmark::kMillisecond);
BENCHMARK(AdamWBf16Copy)->Unit(benchmark::kMillisecond);

void Bf16Refresh(benchmark::State& state) {
  const int64_t n = 20'000'000;
  const std::vector<float> p = random_values(size_t(n), 1);
  std::vector<uint16_t> bf16(static_cast<size_t>(n));
  for (auto _ : state) {
    parallel_for(n, int64_t(1) << 16, [&](int64_t i0, int64_t i1) {
      convert_f32_to_bf16(p.data() + i0, bf16.data() + i0, size_t(i1 - i0));
    });
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 6);
}
BENCHMARK(Bf16Refresh)->Unit(benchmark::kMillisecond);

void SumSquares(benchmark::State& state) {
  const int64_t n = 20'000'000;
  const std::vector<float> g = random_values(size_t(n), 2, 0.1f);
  for (auto _ : state) benchmark::DoNotOptimize(sum_squares(g.data(), n));
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 4);
}
BENCHMARK(SumSquares)->Unit(benchmark::kMillisecond);

// fp8 block quantization as a weight update runs it: bands of 128 bf16 rows (the medium
// preset's expert widths, 1024 and 2048 columns) read from 64 MiB of shards into a 32 MiB
// destination, on each kernel version the CPU has (scalar 0, AVX2 1, AVX-512 2). Items are
// elements; the time per element is what `bench transfer --dtype fp8` spends preparing. Bytes
// are the memory traffic of one element: 2 read (the second pass reads from L2) and 1 written.
void Fp8Quantize(benchmark::State& state) {
  const int64_t cols = state.range(0), rows = 128, block = 128;
  const auto isa = static_cast<Fp8Isa>(state.range(1));
  if (isa > fp8_best_isa()) return state.SkipWithError("this CPU has not the instructions");
  state.SetLabel(fp8_isa_name(isa));
  const int64_t elements = int64_t(32) << 20, bands = elements / (rows * cols);
  std::vector<float> values = random_values(size_t(elements), 3, 0.02f);
  std::vector<uint16_t> src(values.size());
  for (size_t i = 0; i < values.size(); ++i) src[i] = f32_to_bf16(values[i]);
  values = {};
  std::vector<uint8_t> dst(static_cast<size_t>(elements));
  std::vector<float> scales(size_t(cols / block));
  std::vector<Fp8Row> band(static_cast<size_t>(rows));
  for (auto _ : state) {
    for (int64_t b = 0; b < bands; ++b) {
      for (int64_t r = 0; r < rows; ++r) {
        band[size_t(r)] = {src.data() + (b * rows + r) * cols, DType::kBF16};
      }
      fp8_quantize_band(band, cols, block, dst.data() + b * rows * cols, scales.data(), isa);
    }
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * elements);
  state.SetBytesProcessed(int64_t(state.iterations()) * elements * 3);
}
BENCHMARK(Fp8Quantize)
    ->ArgsProduct({{1024, 2048}, {0, 1, 2}})
    ->ArgNames({"cols", "isa"})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace wl::kernels

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("cpu", wl::cpu_info().describe());
  benchmark::AddCustomContext("compute_threads", std::to_string(wl::num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
