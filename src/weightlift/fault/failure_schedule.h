// Which pipeline stages are lost at the start of which iteration: every stage drawn every
// iteration with one probability from one seeded stream, whatever happens in the run, plus
// losses named by hand. The schedule depends on nothing but its inputs, so every recovery
// strategy, and the simulation and the real processes alike, meet the same failures.
//
// An iteration is one step of wall-clock: the k-th step a run completes, counting the steps
// a checkpoint rollback repeats (the model's own progress is what rolls back, not time).
#pragma once

#include <cstdint>
#include <vector>

#include "weightlift/core/random.h"

namespace wl::fault {

// A stage lost at the start of an iteration (1-based), on top of the random draws.
struct ScheduledLoss {
  int64_t iteration = 0;
  int stage = 0;
};

class FailureSchedule {
 public:
  FailureSchedule(int stages, double prob, uint64_t seed, std::vector<ScheduledLoss> scheduled = {})
      : stages_(stages), prob_(prob), rng_(seed), scheduled_(std::move(scheduled)) {}

  // The stages lost at the start of iteration `it` (1-based), each once, the drawn ones first.
  // Iterations between the last one asked for and `it` are drawn and passed over, so a
  // process that joins mid-run asks for the current one directly. REQUIRES: `it` greater than
  // every iteration asked for before.
  std::vector<int> at(int64_t it);

 private:
  int stages_;
  double prob_;
  Rng rng_;
  std::vector<ScheduledLoss> scheduled_;
  int64_t drawn_ = 0;  // iterations drawn so far
};

}  // namespace wl::fault
