// The planner's schedule at cluster scale, kept as loads per rank instead of a list of tasks.
//
// plan/planner.h makes the plan an executor replays: one PlanTask (with its name and source pieces)
// per 128-row band per receiver. For Kimi-K2 in fp8 over 128 receivers that is about 18
// million tasks, several GB of strings, and the planner's input is one model::ModelConfig with
// one FSDP mesh shape for every parameter (no MLA, no expert-parallel placement). A simulation
// needs only what each rank sends, receives and quantizes, so this file applies the
// planner's rules (plan/cutting.h: cut at shard boundaries or 128-row bands, direct senders
// where one mesh rank holds every row, bands split across mesh ranks otherwise, on the mesh
// with the fewest bytes, senders by the fewest bytes so far) and adds each task to per-rank
// counters as it is decided.
// The one generalisation: a parameter is held by a placement, a list of meshes (each sharding
// it dim-0 as torch.chunk does), so routed experts can live on their expert-parallel meshes
// while the dense weights are replicated over FSDP meshes (HSDP). With every parameter on one
// placement of all meshes this is exactly plan/planner.cc's input, and the test checks that
// both give the same task count, split bands and bytes per rank.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/core/tensor.h"
#include "weightlift/transfer/layout/inference_layout.h"

namespace wl::transfer {

// Meshes of trainer indices (0 ..< trainers), in mesh-rank order, all of one size; each mesh
// holds every parameter of the placement, sharded dim-0 over its ranks.
struct Placement {
  std::vector<std::vector<int>> meshes;
};

struct ScheduleParam {
  std::string name;
  int64_t rows = 0, cols = 0;  // [rows, cols] view; a 1-D [n] is [n, 1]
  int placement = 0;           // index into ScheduleInput::placements
};

// One task as the planner would emit it, for tests that check coverage at small scale.
struct ScheduleTask {
  int sender = 0;                          // trainer index
  int receiver = 0;                        // receiver index
  const ReceiverTensor* tensor = nullptr;  // in ScheduleInput::layouts
  int64_t row_begin = 0, row_end = 0;      // rows of that tensor
  uint64_t bytes = 0, scale_bytes = 0;
  bool split = false;  // a sub-band of a band split across mesh ranks
};

struct ScheduleInput {
  int trainers = 1;
  DType trainer_dtype = DType::kBF16;  // what shards hold: kBF16 or kF32
  std::vector<Placement> placements;
  std::vector<ScheduleParam> params;
  std::vector<std::vector<ReceiverTensor>> layouts;  // distinct receiver layouts
  std::vector<int> receiver_layout;                  // per receiver, index into layouts
  std::function<void(double)> progress;              // fraction of families done; may be null
  std::function<void(const ScheduleTask&)> on_task;  // every task; may be null (slow if set)
};

// Loads of one mesh group (seed 000: dense first, a barrier, then experts). Bytes, not
// elements. Per trainer index or receiver index.
struct PhaseLoads {
  std::vector<uint64_t> sent;      // bytes written to receivers (data + scales)
  std::vector<uint64_t> messages;  // puts issued: one per task, two for an fp8 band
  std::vector<uint64_t> prepare;   // shard-dtype bytes read to cast or quantize
  // Before its first put (so counted in the dense group): the shared-maxima rounds it takes
  // part in, one per update for each of its meshes that splits a band; the bytes of those
  // meshes' maxima (f32, what each allreduce reduces); the shard bytes of its own sub-bands,
  // read once for their maxima.
  std::vector<uint64_t> maxima_rounds, maxima_bytes, maxima_prepare;
  std::vector<uint64_t> received;  // per receiver: bytes written into it
  std::vector<uint64_t> received_messages;
  uint64_t tasks = 0, split_bands = 0;
  uint64_t whole_bytes = 0, split_bytes = 0;  // task bytes of whole bands (and bf16) / sub-bands
  uint64_t largest_task = 0;                  // bytes, data + scales
  uint64_t largest_task_prepare = 0;          // its prepare bytes
  uint64_t largest_task_messages = 0;         // its puts
};

struct ScheduleLoads {
  PhaseLoads phase[2];  // [0] dense, [1] expert
  uint64_t families = 0;
};

// InvalidArgument when a source names an unknown parameter or runs past its rows or columns,
// a placement is empty or has meshes of different sizes or unknown trainers, or a band that
// no mesh rank holds whole reads parameters on different placements (no one mesh can share
// its maxima).
Result<ScheduleLoads> schedule_loads(const ScheduleInput& input);

}  // namespace wl::transfer
