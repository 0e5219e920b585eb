// Where a training job runs: how many pipeline stages the model is cut into (`pp`), how many
// ranks hold a copy of each stage (data parallel), how each copy keeps its parameters,
// gradients and optimizer state (`dp_mode`), and how the global batch is cut into
// micro-batches. A layout never changes the maths: `batch` is the global batch, each
// micro-batch is the same rows in every layout, and the router's aux and z losses are those of
// a whole micro-batch, whichever ranks hold its rows.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/parallel/layout/pipeline_schedule.h"

namespace wl::parallel {

// The data-parallel modes, by what each rank keeps whole:
//   kDdp    parameters, gradients, optimizer state: gradients allreduced in buckets
//   kZero1  parameters and gradients; the optimizer state of its own shard only
//   kZero2  parameters; gradients reduce-scattered into its shard after each unit's backward
//   kFsdp   nothing: parameters gathered per unit before its forward and backward, and freed
enum class DpMode : uint8_t { kDdp, kZero1, kZero2, kFsdp };

std::string_view dp_mode_name(DpMode m);  // "ddp", "zero1", "zero2", "fsdp"
std::optional<DpMode> dp_mode_from_name(std::string_view name);

// The words of a command line's --dp-mode and --pp-schedule as the enums of `dp_mode` and
// `schedule`; an error names the field and the choices. Schedule auto is ZB where the
// data-parallel mode keeps whole gradients (ddp, zero1) and 1F1B where it does not (zero2,
// fsdp: validate() says why).
Result<DpMode> parse_dp_mode_flag(std::string_view name);
Result<PipelineSchedule> parse_schedule_flag(std::string_view name, DpMode dp_mode);
inline constexpr const char* kScheduleFlagHelp =
    "auto (zb, or 1f1b where the data-parallel mode shards gradients: zero2, fsdp), 1f1b, "
    "gpipe or zb";

struct ParallelLayout {
  DpMode dp_mode = DpMode::kDdp;
  int dp = 1;  // data-parallel ranks: world / (pp x tp)
  int pp = 1;  // pipeline stages (pipeline.h)
  // Tensor parallelism: groups of this many consecutive ranks split every block's heads and
  // ffn rows (model/tensor_slices.h), each holding and running only its own slices.
  int tp = 1;
  // Expert parallelism: groups of this many consecutive data-parallel ranks share out each
  // layer's experts, each rank running and holding only its own (data_parallel.h); it divides
  // dp and the experts.
  int ep = 1;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // The global batch is cut into this many micro-batches per step, each run forward and
  // backward before the next (gradient accumulation); each data-parallel rank takes an equal
  // share of every micro-batch's rows.
  int micro_batches = 1;
  // DDP and ZeRO-1 reduce gradients in buckets of about this many bytes, each as soon as the
  // backward pass has finished the units in it. PyTorch DDP's default.
  int64_t bucket_bytes = int64_t(25) << 20;

  bool shards_parameters() const { return dp_mode == DpMode::kFsdp; }
  bool shards_gradients() const { return dp_mode == DpMode::kZero2 || shards_parameters(); }
  bool shards_optimizer() const { return dp_mode != DpMode::kDdp; }
};

// A layout that fits `world` ranks, the model and a global batch of `batch` rows: errors name
// the field (`tp`, `micro_batches`; `batch` for the batch).
Status validate(const ParallelLayout& layout, int world, const model::ModelConfig& config,
                int64_t batch);
// The parts of validate() that need no world: `ep` against the data-parallel size and the
// experts, `tp` against the heads and ffn rows, and `batch` against micro-batches x
// data-parallel ranks.
Status check_expert_parallel(const ParallelLayout& layout, const model::ModelConfig& config);
Status check_tensor_parallel(const ParallelLayout& layout, const model::ModelConfig& config);
Status check_batch(const ParallelLayout& layout, int64_t batch);

// Where job rank `rank` sits: stage-major, tensor-parallel ranks innermost
// (rank = (stage * dp + data-parallel rank) * tp + tensor-parallel rank), so that a TP group,
// which sums several times per block, is consecutive ranks and shares a host.
struct LayoutPlace {
  int stage = 0, dp_rank = 0, tp_rank = 0;
};
LayoutPlace place_in(const ParallelLayout& layout, int rank);

// Rows [begin, end) of the global batch that data-parallel rank `rank` takes of micro-batch m.
struct RowRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
RowRange micro_batch_rows(const ParallelLayout& layout, int64_t batch, int micro_batch, int rank);

}  // namespace wl::parallel
