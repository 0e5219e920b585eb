// A micro-batch's way through a pipeline of block stages (CheckFree's stages), and which
// process runs each piece of it.
//
// The model's blocks are cut into stages of equal depth; on real processes, process s holds
// block stage s, the first process the embedding too and the last one the head
// (parallel/pipeline/pipeline.h's layout). A micro-batch runs the embedding, the block stages in
// its order, then the head. CheckFree+ runs every other micro-batch with the first two and the last
// two block stages exchanged, so that each learns to stand in for its partner:
//
//   normal    E [B0] [B1] [B2] [B3] H      processes  [0: E B0] [1: B1] [2: B2] [3: B3 H]
//   swapped   E [B1] [B0] [B3] [B2] H      processes  [0: E] [1: B1] [0: B0] [3: B3] [2: B2] [3: H]
//
// Consecutive pieces on one process whose units follow each other run as one pass (a
// segment), so the normal order is parallel/pipeline/pipeline.h's pipeline exactly.
#pragma once

#include <span>
#include <vector>

#include "weightlift/model/pass.h"

namespace wl::fault {

// The block stages in order, and in CheckFree+'s swapped order (0 <-> 1, S-2 <-> S-1; with
// fewer than 4 stages only what exists is swapped).
std::vector<int> normal_order(int stages);
std::vector<int> swapped_order(int stages);

// Part of a micro-batch's route that one process runs as one pass.
struct Segment {
  int process = 0;     // the process holding these units: block stage s lives on process s
  model::Stage units;  // units [first, last] (model/units.h numbering)
};

// The segments of a micro-batch whose block stages run in `order` (a permutation of the
// stages), `blocks[s]` being block stage s's units and `head` the head's unit.
// REQUIRES: blocks[s] are consecutive runs of blocks starting at unit 1, `order` a
// permutation of 0 .. blocks.size() - 1.
std::vector<Segment> route(std::span<const model::Stage> blocks, int head,
                           std::span<const int> order);

}  // namespace wl::fault
