// A Linear layer over weights as the inference layout stores them (bf16, or fp8 e4m3 with
// 128x128 block scales), dequantized on the fly one band of rows at a time.
//
//   y[n, rows] = x[n, cols] @ W[rows, cols]^T       (or += when accumulating)
//
// Per band of rows (a multiple of 128, so an fp8 band covers whole scale blocks): widen the
// band to f32 in a scratch buffer (bf16: exact; fp8: q * scale, one rounding, the dequantized
// value DeepSeek-V3 defines), then one f32 oneDNN GEMM of all n activation rows against it,
// writing the band's output columns in place (ldc = rows).
//
// Why bands and not the whole model dequantized up front: an f32 copy is 4x the fp8 bytes
// (2x bf16) for every matrix, which defeats fp8's point and would have to be redone after
// every weight update anyway. Where that memory is there, widen_weights() makes the copy once
// per generation, which the decode steps then share: on `small` on a Zen 4, 1.5x the decode
// tokens/s at 8 x 8 in bf16 and 2.5x in fp8; on an AVX2 EPYC at one thread and a few new
// tokens it lost (0.8x: the f32 copy is twice the bytes a decode step reads; BENCHMARKS.md).
// Why not per row: the GEMM then degenerates to GEMVs and the n activation rows get re-read per
// weight row. A band is sized to about 256 KiB of f32 (L2-resident), dequantized once per call
// and reused by every activation row, so the extra work is one pass over the weight bytes, the
// same traffic a fused dequant-GEMM would have. Activations stay f32 (no rounding of x), so the
// only error against an f32 model is the weights' own rounding.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/core/aligned.h"
#include "weightlift/infer/weights.h"

namespace wl::infer {

// Rows [r0, r1) of w as f32 into dst [r1 - r0, w.cols]. fp8: q * scale of the row's and
// column's 128x128 block.
void dequantize_rows(const WeightMatrix& w, int64_t r0, int64_t r1, float* dst);

// Whether this CPU multiplies bf16 in hardware (AVX512-BF16, which every AMX CPU has too) and
// oneDNN builds bf16 GEMMs for it: where bf16_activations below takes effect.
bool bf16_activations_supported();

// Every matrix of `w` the forward pass multiplies (attention, MLPs, experts, router, head; not
// the embedding, which is read a row at a time) widened to f32 once, into `storage`: the
// views returned read from it, so it must outlive them. bf16 matrices stay as stored when
// `keep_bf16` (bf16_activations multiplies them so). What a generation that runs many steps
// on one weight version does (WorkerOptions::widen_per_generation): one widening pass in all
// instead of one per step, for an f32 copy of the weights held while it runs.
BoundWeights widen_weights(const BoundWeights& w, bool keep_bf16,
                           std::vector<AlignedVector<float>>& storage);

// x: [n, w.cols] f32; y: [n, w.rows] f32, overwritten, or added to when `accumulate`.
// `scratch` grows to one band (about 64 Ki floats, or 128 rows when a row is longer); aligned,
// since the GEMM reads the band from it (core/aligned.h).
//
// bf16_activations, where bf16_activations_supported(): a bf16 matrix is multiplied as it is
// stored, against x rounded to bf16 (one rounding per activation, as bf16 autocast does; f32
// accumulation) in a buffer of this call, with no widening pass and half the weight bytes
// read. fp8 matrices, and other CPUs (oneDNN would emulate bf16 there), take the f32 path.
// An f32 matrix (widen_weights') is multiplied as it is, in one GEMM.
void dequant_linear(const WeightMatrix& w, const float* x, int64_t n, float* y, bool accumulate,
                    AlignedVector<float>& scratch, bool bf16_activations = false);

}  // namespace wl::infer
