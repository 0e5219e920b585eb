// Batches of training windows from a token stream.
//
// Each batch row is a random window of seq + 1 tokens: inputs are its first seq, targets its
// last seq. Windows start at positions drawn from a seeded Rng, so the data position of a run
// is the Rng's state, which a checkpoint stores; a resumed run draws the same windows.
// Validation uses fixed, evenly spaced windows so its loss is comparable across runs.
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
  Batch next(int64_t batch, int64_t seq);  // stream must hold more than seq tokens (checked)
  Rng& rng() { return rng_; }

 private:
  const std::vector<int64_t>* stream_;  // borrowed
  Rng rng_;
};

// `count` windows spaced evenly over the stream, in batches of `batch` rows.
std::vector<Batch> fixed_windows(const std::vector<int64_t>& stream, int64_t count, int64_t batch,
                                 int64_t seq);

}  // namespace wl::train
