// The bf16 copies of a model's weights that its GEMMs read, made once per optimizer step.
//
// On a CPU with bf16 dot products (AVX-512 BF16, AMX) a kBF16 Linear runs on bf16 operands
// (model/detail/linear.cc). Converting its f32 weight on every call costs a read of 4 bytes and a
// write of 2 per weight, two or three times per micro-batch (forward, the backward's input
// gradient, and a gradient-checkpointing rerun), and again for every micro-batch of a step; the
// weights do not change in between. A trainer that opens a WeightCopies for the passes of a step
// has each weight converted on its first use there and read from the copy after.
//
// The promise that makes this correct is the caller's: between open() and close() no one
// writes the weights the passes read. A trainer opens it after its last write (the optimizer
// step, a load, a sync) and closes it before the next (parallel/data/step.cc scopes it to a
// step's forward and backward passes). Closed, get() gives nothing and every GEMM converts its
// weight per call, as without copies. A copy is found by what the weight is (layer, role,
// expert), not by its address, and is made again when the same weight turns up at another
// address.
//
// Copies stay allocated between steps (2 bytes per weight read at bf16) so a step makes no
// allocation. Not thread-safe: one trainer's passes, on its compute thread.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "weightlift/core/aligned.h"
#include "weightlift/model/params.h"

namespace wl::model {

// Which weight: its layer (-1 for the embedding and the head), its role in the layer, and for
// an expert's matrices the expert (-1 otherwise).
struct WeightKey {
  int32_t layer = -1;
  ParamRole role = ParamRole::kNorm;
  int32_t expert = -1;
};

class WeightCopies {
 public:
  void open();   // the weights hold still from here; copies made before are stale
  void close();  // the weights may change
  bool is_open() const { return open_; }

  // The bf16 copy of w [n] (f32), made now if this opening has none of `key` at `w`; null when
  // closed.
  const uint16_t* get(const WeightKey& key, const float* w, int64_t n);

  int64_t bytes() const;                                // held by the copies
  int64_t conversions() const { return conversions_; }  // copies made since construction

 private:
  struct Copy {
    AlignedVector<uint16_t> data;
    const float* source = nullptr;
    uint64_t opening = 0;  // made during this opening
  };
  std::unordered_map<uint64_t, Copy> copies_;
  uint64_t opening_ = 0;
  bool open_ = false;
  int64_t conversions_ = 0;
};

}  // namespace wl::model
