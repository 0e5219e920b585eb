// Batches of training windows from a token stream, or of example rows.
//
// Each batch row is a random window of seq + 1 tokens: inputs are its first seq, targets its
// last seq. Or, over a fixed set of example rows (SFT, sft.h), a row drawn at random. Windows start
// at positions drawn from a seeded Rng, so the data position of a run is the Rng's state, which a
// checkpoint stores; a resumed run draws the same windows. Validation uses fixed, evenly spaced
// windows so its loss is comparable across runs.
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/core/random.h"

namespace wl::train {

struct Batch {
  int64_t batch = 0, seq = 0;
  std::vector<int64_t> tokens, targets;  // [batch, seq] each
};

class WindowSampler {
 public:
  WindowSampler(const std::vector<int64_t>* stream, uint64_t seed) : stream_(stream), rng_(seed) {}
  // Rows of `examples` ([n, seq]) instead of windows.
  WindowSampler(const Batch* examples, uint64_t seed) : examples_(examples), rng_(seed) {}
  // The stream must hold more than seq tokens; the examples' rows must be seq long (checked).
  Batch next(int64_t batch, int64_t seq);
  Rng& rng() { return rng_; }

 private:
  const std::vector<int64_t>* stream_ = nullptr;  // borrowed
  const Batch* examples_ = nullptr;               // borrowed
  Rng rng_;
};

// `count` windows spaced evenly over the stream, in batches of `batch` rows.
std::vector<Batch> fixed_windows(const std::vector<int64_t>& stream, int64_t count, int64_t batch,
                                 int64_t seq);

}  // namespace wl::train
