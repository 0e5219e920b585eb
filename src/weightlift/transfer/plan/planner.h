// The planner: from every rank's metadata, the static schedule an update replays.
//
// The unit of work is a task: one contiguous byte range of one receiver tensor (a band of
// whole rows), produced by one trainer and written by one put (plus one for its scale row in
// fp8). How the rows are cut:
//   - bf16 (and the bf16 tensors of an fp8 receiver): each source slice is cut at the mesh's
//     shard boundaries. Every piece then lies inside one mesh rank's dim-0 shard, so that rank
//     (in whichever mesh replica has sent the fewest bytes so far) sends it straight from its
//     shard: no gather at all, and no byte moves twice.
//   - fp8 matrices: a block scale needs all 128 rows of its band, so the task is a 128-row
//     band. If one mesh rank's shards hold every row of the band, that rank quantizes it from
//     its shards directly. Otherwise the band is split at the shard boundaries into sub-bands,
//     one task each, all sent by the ranks of one mesh (the one with the fewest bytes so far):
//     each rank adds the block maxima of its rows to its mesh's shared maxima, one allreduce
//     per mesh and update takes their maximum, and each quantizes its own rows with the
//     band's scales. Seed 000 gathers the parameters (full_tensor()) instead; here no byte of
//     a parameter moves between trainers, which on a mesh across hosts kept each gather
//     queued behind the other host's puts (docs/BENCHMARKS.md, 2026-12-03).
// Families (a receiver tensor name: the same fused tensor on every TP rank) are taken in
// order, dense before expert as in seed 000, so the small dense weights are not queued behind
// the experts.
//
// Validation happens here, before any byte moves: every refusal names the tensor and the rank
// (docs/errors.md codes): a receiver tensor that no parameter produces (NotFound), a shape or
// dtype mismatch or a TP degree the model cannot be split by (InvalidArgument), a trainer
// without a parameter the layout needs (NotFound), shards that do not match their mesh
// position (InvalidArgument). A stale rkey (a receiver restarted after planning) is caught
// when an update starts (modes/p2p.h), since only then can the receiver's current epoch be
// compared.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/transfer/plan/metadata.h"

namespace wl::transfer {

// Rows [row_begin, row_end) x columns [col_begin, col_end) of `param` land on receiver tensor
// rows starting at dst_row.
struct PlanPiece {
  std::string param;
  int64_t row_begin = 0, row_end = 0, col_begin = 0, col_end = 0;
  int64_t dst_row = 0;
};

struct PlanTask {
  int sender = 0;      // world rank of the trainer that produces and writes it
  int receiver = 0;    // world rank of the receiver
  std::string tensor;  // receiver tensor name
  bool expert = false;
  // A sub-band of a band split across mesh ranks: the first of its band's block maxima in its
  // mesh's shared maxima (Plan::maxima_floats); -1: its rows are the whole band (or bf16).
  int64_t maxima = -1;
  int64_t row_begin = 0, row_end = 0;  // rows of the receiver tensor (as [rows, cols])
  int64_t cols = 0;
  DType dtype = DType::kBF16;                  // what lands: kBF16 or kF8E4M3
  uint64_t dst_offset = 0, bytes = 0;          // in a receiver slot, bytes
  uint64_t scale_offset = 0, scale_bytes = 0;  // fp8: the band's row of the scale tensor
                                               // (of a split band, on its first sub-band only)
  std::vector<PlanPiece> pieces;
  uint64_t total_bytes() const { return bytes + scale_bytes; }
  bool quantized() const { return dtype == DType::kF8E4M3; }
};

struct PlanTrainer {
  int rank = 0, mesh_id = 0, mesh_rank = 0;
};

struct PlanReceiver {
  int rank = 0, engine = 0, tp = 1, tp_rank = 0, ep = 1, ep_rank = 0;
  WeightFormat format = WeightFormat::kBF16;
  uint64_t epoch = 0;
  std::vector<std::byte> worker_address;
  uint64_t slot_address[2] = {0, 0};
  uint64_t slot_bytes = 0;
  std::vector<std::byte> rkey;
};

struct Plan {
  // Version 2: "format_version" (was "version") and each receiver's "engine" (was "instance").
  // Version 3: split bands share "maxima_floats" per mesh; no "gathers", no task "gather".
  static constexpr RecordFormat kFormat{.name = "weightlift-transfer-plan",
                                        .version = 3,
                                        .what = "transfer plan",
                                        .remedy = "plan again with this build"};
  std::string config_json;  // our model's config; empty when the trainers hold a layout spec's
  std::string layout_name;  // then that spec's name
  int mesh_size = 1, num_meshes = 1;
  std::vector<PlanTrainer> trainers;    // by world rank
  std::vector<PlanReceiver> receivers;  // by world rank
  // By mesh: the floats of its shared block maxima, one allreduce per update (0: none).
  std::vector<int64_t> maxima_floats;
  std::vector<PlanTask> tasks;  // the global order; dense before experts

  const PlanTrainer* find_trainer(int rank) const;
  const PlanReceiver* find_receiver(int rank) const;
};

Result<Plan> make_plan(std::span<const RankMeta> ranks);

// Versioned JSON (docs/formats.md, "Transfer plan"). plan_from_json refuses another format
// (DataLoss) or version (FailedPrecondition) with an error that says which was expected.
std::string plan_to_json(const Plan& plan);
Result<Plan> plan_from_json(std::string_view json, std::string_view where);

// Bytes each rank sends (trainers) or receives (receivers), indexed by world rank.
std::vector<uint64_t> plan_bytes_by_rank(const Plan& plan);

}  // namespace wl::transfer
