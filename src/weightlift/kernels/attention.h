// Causal multi-query / grouped-query attention, flash style.
//
// The forward pass walks key blocks with an online softmax (running max and sum per query
// row), so the [seq_q, seq_kv] score matrix never exists in memory; it saves the per-row
// logsumexp for the backward pass, which recomputes the probabilities block by block.
// Query head h reads key/value head h / (heads / kv_heads).
// Query row t (0-based in this call) sits at position q_offset + t of the key sequence and
// attends to keys 0 ..= q_offset + t (causal). Scale is 1/sqrt(head_dim).
#pragma once

#include <cstdint>
#include <span>

namespace wl::kernels {

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq_q = 0;     // query rows in this call
  int64_t seq_kv = 0;    // keys visible: q_offset + seq_q for training / prefill / decode
  int64_t heads = 0;     // query heads
  int64_t kv_heads = 0;  // divides heads
  int64_t head_dim = 0;
  int64_t q_offset = 0;  // seq_kv - seq_q in all our uses
  // Elements between consecutive batch rows of k and v; 0 means seq_kv * kv_heads * head_dim.
  // A KV cache of capacity C passes C * kv_heads * head_dim.
  int64_t kv_batch_stride = 0;
};

// q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim] (rows
// kv_batch_stride apart); out: [batch, seq_q, heads, head_dim];
// lse: [batch, heads, seq_q] logsumexp of the scaled scores (may be null when not training).
void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse);

// Keys and values of `tokens` consecutive positions, each position's kv_heads * head_dim
// floats right after the previous one's: a page of a paged KV cache.
struct KvSegment {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t tokens = 0;
};

// attention_forward for one batch row whose keys and values lie in segments, in position
// order, that together hold at least seq_kv positions (kv_batch_stride is ignored). The same
// online softmax over key blocks that never straddle a segment, so a segment of any length
// costs no copy; up to f32 reassociation, the result is attention_forward's over the keys
// laid end to end.
void attention_forward_paged(const AttentionShape& s, const float* q, std::span<const KvSegment> kv,
                             float* out, float* lse);

// Gradients; dq overwritten [batch, seq_q, heads, head_dim]; dk, dv overwritten
// [batch, seq_kv, kv_heads, head_dim] (dense, kv_batch_stride ignored: training only).
void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv);

// Materialises the full score matrix, in double; for tests.
void attention_forward_reference(const AttentionShape& s, const float* q, const float* k,
                                 const float* v, float* out);

}  // namespace wl::kernels
