// Training checkpoints for every layout: everything a run needs to continue bit-exactly, and
// nothing it cannot trust.
//
// A checkpoint is a directory:
//   rank-<r>-of-<n>.safetensors  rank r's own rows (core/shard.h, over the ranks that hold
//                                the tensor: UnitParts::holders) of every parameter of its
//                                stage, "<name>", and of its AdamW moments, "m.<name>"
//                                and "v.<name>", f32, shaped [rows, ...]; its metadata holds
//                                each tensor's XXH3-64 checksum, "xxh3.<name>"
//   state.json                   format version 3 (train/checkpoint_state.h): the counters, the
//                                config, the layout, the run's hyperparameters, the index of
//                                the tensors' pieces, a checksum of each rank file's checksums,
//                                and a checksum of itself
// Every rank writes its file into a staging directory of this save's own (`<dir>.tmp.<n>`, n
// drawn by rank 0); once all have (agreed by a sum over the ranks, so one rank's full disk
// fails every rank's save), rank 0 writes state.json and exchanges the directory into place
// (core/file_io.h), so a crash leaves the previous checkpoint whole. Parameters or moments
// that are not finite (or a v below zero) on any rank are never written: the save fails on
// every rank and the last good checkpoint stays.
//
// Loading asks the rank's DataParallel which rows of which states it needs (all rows where a
// state is whole on it, its own where sharded) and copies each from the pieces that overlap
// it, so a checkpoint written in any layout loads into any other; the same layout reads back
// exactly what was written. Every file read is checked against state.json and every tensor
// against its checksum; an index that lies (rows outside the shape, a piece missing from its
// file or shaped otherwise, rows no piece covers), a checksum that does not match, or loaded
// rows that are not finite (or a negative v) is DataLoss naming the file and tensor, on every
// rank. Versions 1 and 2, which carried no checksums, are refused as such. docs/formats.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/train/checkpoint_state.h"

namespace wl::parallel {

// The counters, the data position and the run's hyperparameters (train/checkpoint_state.h).
using TrainState = train::CheckpointState;

// Collective over the data-parallel ranks. `extra_files` (name -> bytes, written by rank 0)
// go into the checkpoint with everything else, before it is moved into place: a layer above
// keeps its own state in the same all-or-nothing directory.
Status save_checkpoint(const std::string& dir, DataParallel& dp, const TrainState& state,
                       const std::map<std::string, std::string>& extra_files = {});

// Collective as well (every rank reads what it needs). A different model config is an error.
Result<TrainState> load_checkpoint(const std::string& dir, DataParallel& dp);

// The counters of checkpoint `dir`'s state.json (a regular file of at most 64 MiB, its
// checksum verified), read without its tensors: what a run checks before it allocates
// anything (run_guard.h).
Result<TrainState> read_checkpoint_state(const std::string& dir);

}  // namespace wl::parallel
