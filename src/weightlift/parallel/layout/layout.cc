// layout.h.
#include "weightlift/parallel/layout/layout.h"

#include <string>

#include "weightlift/core/check.h"
#include "weightlift/model/tensor_slices.h"

namespace wl::parallel {

std::string_view dp_mode_name(DpMode m) {
  switch (m) {
    case DpMode::kDdp:
      return "ddp";
    case DpMode::kZero1:
      return "zero1";
    case DpMode::kZero2:
      return "zero2";
    case DpMode::kFsdp:
      return "fsdp";
  }
  return "?";
}

std::optional<DpMode> dp_mode_from_name(std::string_view name) {
  for (DpMode m : {DpMode::kDdp, DpMode::kZero1, DpMode::kZero2, DpMode::kFsdp}) {
    if (dp_mode_name(m) == name) return m;
  }
  return std::nullopt;
}

Result<DpMode> parse_dp_mode_flag(std::string_view name) {
  if (auto m = dp_mode_from_name(name)) return *m;
  return invalid_argument("`dp_mode` '" + std::string(name) +
                          "': expected ddp, zero1, zero2 or fsdp");
}

Result<PipelineSchedule> parse_schedule_flag(std::string_view name, DpMode dp_mode) {
  if (name == "auto") {
    return ParallelLayout{.dp_mode = dp_mode}.shards_gradients() ? PipelineSchedule::k1F1B
                                                                 : PipelineSchedule::kZeroBubble;
  }
  if (auto s = pipeline_schedule_from_name(name)) return *s;
  return invalid_argument("`schedule` '" + std::string(name) +
                          "': expected auto, 1f1b, gpipe or zb");
}

Status validate(const ParallelLayout& l, int world, const model::ModelConfig& c, int64_t batch) {
  if (l.pp > 1 && l.schedule == PipelineSchedule::kZeroBubble && l.shards_gradients()) {
    return invalid_argument(
        "`schedule` zb runs each unit's weight gradients after every "
        "unit's input gradients, and `dp_mode` " +
        std::string(dp_mode_name(l.dp_mode)) +
        " holds a unit's gradients only while its backward runs: use ddp "
        "or zero1, or another schedule");
  }
  if (l.tp < 1 || world % l.tp != 0) {
    return invalid_argument("`tp` " + std::to_string(l.tp) + " does not divide the " +
                            std::to_string(world) + " ranks");
  }
  if (l.pp < 1 || world % l.pp != 0) {
    return invalid_argument("`pp` " + std::to_string(l.pp) + " does not divide the " +
                            std::to_string(world) + " ranks");
  }
  if (const int64_t cut = int64_t(l.pp) * l.tp; world % cut != 0) {  // two ints: no overflow
    return invalid_argument("`pp` " + std::to_string(l.pp) + " x `tp` " + std::to_string(l.tp) +
                            " = " + std::to_string(cut) + " does not divide the " +
                            std::to_string(world) + " ranks");
  }
  if (l.pp > c.num_layers) {
    return invalid_argument("`pp` " + std::to_string(l.pp) + " stages for " +
                            std::to_string(c.num_layers) +
                            " layers: every stage needs at least one");
  }
  if (l.dp < 1 || int64_t(l.dp) * l.pp * l.tp != world) {
    return invalid_argument("data-parallel size " + std::to_string(l.dp) + " x " +
                            std::to_string(l.pp) + " stages x `tp` " + std::to_string(l.tp) +
                            " does not fit " + std::to_string(world) + " ranks");
  }
  WL_RETURN_IF_ERROR(check_expert_parallel(l, c));
  WL_RETURN_IF_ERROR(check_tensor_parallel(l, c));
  if (l.micro_batches < 1) {
    return invalid_argument("`micro_batches` " + std::to_string(l.micro_batches) +
                            ": expected at least 1");
  }
  if (l.bucket_bytes < 1) {
    return invalid_argument("`bucket_bytes` " + std::to_string(l.bucket_bytes) +
                            ": expected at least 1");
  }
  return check_batch(l, batch);
}

Status check_expert_parallel(const ParallelLayout& l, const model::ModelConfig& c) {
  if (l.ep < 1 || l.dp % l.ep != 0) {
    return invalid_argument("`ep` " + std::to_string(l.ep) +
                            " does not divide the data-parallel size " + std::to_string(l.dp) +
                            " (world / `pp`)");
  }
  if (l.ep > 1 && c.moe_layers() == 0) {
    return invalid_argument("`ep` " + std::to_string(l.ep) +
                            ": the model has no MoE layer, so no experts to place");
  }
  if (c.num_experts % l.ep != 0) {
    return invalid_argument("`ep` " + std::to_string(l.ep) + " does not divide the " +
                            std::to_string(c.num_experts) + " experts of a layer");
  }
  return ok_status();
}

Status check_tensor_parallel(const ParallelLayout& l, const model::ModelConfig& c) {
  return model::check_tensor_parallel(c, l.tp, "`tp`");
}

Status check_batch(const ParallelLayout& l, int64_t batch) {
  const int64_t parts = int64_t(l.micro_batches) * l.dp;  // two ints: no overflow
  if (batch < 1 || parts < 1 || batch % parts != 0) {
    return invalid_argument("`batch` " + std::to_string(batch) + " must be a multiple of " +
                            std::to_string(l.micro_batches) + " micro-batches x " +
                            std::to_string(l.dp) +
                            " data-parallel ranks = " + std::to_string(parts));
  }
  return ok_status();
}

LayoutPlace place_in(const ParallelLayout& l, int rank) {
  WL_CHECK(rank >= 0 && rank < l.dp * l.pp * l.tp) << "rank " << rank;
  const int replica = rank / l.tp;  // stage * dp + dp_rank
  return {replica / l.dp, replica % l.dp, rank % l.tp};
}

RowRange micro_batch_rows(const ParallelLayout& l, int64_t batch, int micro_batch, int rank) {
  WL_CHECK(micro_batch >= 0 && micro_batch < l.micro_batches && rank >= 0 && rank < l.dp)
      << "micro-batch " << micro_batch << " rank " << rank;
  const int64_t per_micro = batch / l.micro_batches, per_rank = per_micro / l.dp;
  const int64_t begin = micro_batch * per_micro + rank * per_rank;
  return {begin, begin + per_rank};
}

}  // namespace wl::parallel
