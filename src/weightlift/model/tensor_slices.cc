#include "weightlift/model/tensor_slices.h"

#include <cstring>
#include <string>
#include <vector>

namespace wl::model {

Status check_tensor_parallel(const ModelConfig& c, int tp, std::string_view where) {
  const std::string at(where);
  const std::string t = std::to_string(tp);
  if (tp < 1) return invalid_argument(at + ": the TP degree must be at least 1, not " + t);
  if (c.num_heads % tp != 0) {
    return invalid_argument(at + ": tp " + t + " does not divide num_heads " +
                            std::to_string(c.num_heads));
  }
  if (c.num_kv_heads >= tp ? c.num_kv_heads % tp != 0 : tp % c.num_kv_heads != 0) {
    return invalid_argument(at + ": num_kv_heads " + std::to_string(c.num_kv_heads) +
                            " is neither a multiple nor a divisor of tp " + t);
  }
  if (c.ffn_dim % tp != 0) {
    return invalid_argument(at + ": tp " + t + " does not divide ffn_dim " +
                            std::to_string(c.ffn_dim));
  }
  if (c.dense_ffn_dim % tp != 0) {
    return invalid_argument(at + ": tp " + t + " does not divide dense_ffn_dim " +
                            std::to_string(c.dense_ffn_dim));
  }
  return ok_status();
}

ModelConfig tp_config(const ModelConfig& c, int tp) {
  WL_CHECK(check_tensor_parallel(c, tp, "tp_config").ok()) << "tp " << tp;
  ModelConfig l = c;
  l.num_heads = c.num_heads / tp;
  l.num_kv_heads = c.num_kv_heads >= tp ? c.num_kv_heads / tp : 1;
  l.ffn_dim = c.ffn_dim / tp;
  l.dense_ffn_dim = c.dense_ffn_dim / tp;
  return l;
}

int kv_copies(const ModelConfig& c, int tp) {
  return c.num_kv_heads < tp ? int(tp / c.num_kv_heads) : 1;
}

TensorSlice tensor_slice(const ModelConfig& c, const ParamInfo& p, int tp, int rank) {
  WL_CHECK(rank >= 0 && rank < tp) << "tp rank " << rank << " of " << tp;
  // Columns from the shape, not numel / rows: an empty [0, n] (a dense model's expert
  // width) is still n wide.
  const int64_t rows = p.shape[0];
  int64_t cols = 1;
  for (size_t i = 1; i < p.shape.size(); ++i) cols *= p.shape[i];
  const TensorSlice whole{{0, rows}, {0, cols}, rank == 0};
  if (tp == 1) return whole;
  const int64_t dh = c.head_dim;
  auto band = [&](int64_t n) { return ShardRows{rank * n, (rank + 1) * n}; };
  switch (p.role) {
    case ParamRole::kQ:
      return {band(c.num_heads / tp * dh), {0, cols}, true};
    case ParamRole::kK:
    case ParamRole::kV: {
      if (c.num_kv_heads >= tp) return {band(c.num_kv_heads / tp * dh), {0, cols}, true};
      const int copies = kv_copies(c, tp);
      const int64_t head = rank / copies;
      return {{head * dh, (head + 1) * dh}, {0, cols}, rank % copies == 0};
    }
    case ParamRole::kO:
      return {{0, rows}, band(c.num_heads / tp * dh), true};
    case ParamRole::kGate:  // an expert's ffn_dim rows or a dense MLP's dense_ffn_dim
    case ParamRole::kUp:
      return {band(rows / tp), {0, cols}, true};
    case ParamRole::kDown:
      return {{0, rows}, band(cols / tp), true};
    case ParamRole::kEmbed:
    case ParamRole::kNorm:
    case ParamRole::kRouter:
    case ParamRole::kHead:
      return whole;
  }
  WL_CHECK(false) << "unknown role of " << p.name;
  return whole;
}

namespace {

// Calls fn(global param, local param, slice) for every parameter, checking that the two
// layouts are the same parameters and that each local shape is its slice.
template <typename Fn>
void for_each_slice(const ModelConfig& c, const ParamLayout& global, const ParamLayout& local,
                    int tp, int rank, Fn&& fn) {
  WL_CHECK(global.params().size() == local.params().size())
      << "a TP rank's layout has " << local.params().size() << " parameters, the model "
      << global.params().size();
  for (size_t i = 0; i < global.params().size(); ++i) {
    const ParamInfo& g = global.params()[i];
    const ParamInfo& l = local.params()[i];
    const TensorSlice s = tensor_slice(c, g, tp, rank);
    WL_CHECK(g.name == l.name && l.shape[0] == s.rows.size() &&
             l.numel() == s.rows.size() * s.cols.size())
        << "TP rank " << rank << " of " << tp << ": local " << l.name << " is not the slice of "
        << g.name;
    fn(g, l, s, i);
  }
}

}  // namespace

void slice_params(const ModelConfig& c, const ParamLayout& global_layout,
                  const ParamLayout& local_layout, int tp, int rank, const float* global,
                  float* local) {
  for_each_slice(c, global_layout, local_layout, tp, rank,
                 [&](const ParamInfo& g, const ParamInfo& l, const TensorSlice& s, size_t) {
                   const int64_t width = g.numel() / g.shape[0], n = s.cols.size();
                   for (int64_t r = s.rows.begin; r < s.rows.end; ++r) {
                     std::memcpy(local + l.offset + (r - s.rows.begin) * n,
                                 global + g.offset + r * width + s.cols.begin, size_t(n) * 4);
                   }
                 });
}

void unslice_owned(const ModelConfig& c, const ParamLayout& global_layout,
                   const ParamLayout& local_layout, int tp, int rank,
                   std::span<const size_t> params, const float* local, float* global) {
  std::vector<bool> wanted(global_layout.params().size(), false);
  for (size_t i : params) wanted.at(i) = true;
  for_each_slice(c, global_layout, local_layout, tp, rank,
                 [&](const ParamInfo& g, const ParamInfo& l, const TensorSlice& s, size_t i) {
                   if (!wanted[i] || !s.owner) return;
                   const int64_t width = g.numel() / g.shape[0], n = s.cols.size();
                   for (int64_t r = s.rows.begin; r < s.rows.end; ++r) {
                     std::memcpy(global + g.offset + r * width + s.cols.begin,
                                 local + l.offset + (r - s.rows.begin) * n, size_t(n) * 4);
                   }
                 });
}

}  // namespace wl::model
