// One training step of a pipeline that may lose stages, one process per block stage: the
// micro-batches along their routes (stage_route.h: CheckFree+ swaps every other one), the
// ends' gradient to its replica, then the commit.
//
// Order. Every process runs its passes in GPipe's global order: the forwards of micro-batch
// 0, 1, ..., each along its route, then the backwards in the same micro-batch order, each
// along its route reversed. A receive only ever waits for a pass earlier in that order and
// sends never wait, so a route that visits a process twice (the swapped one) cannot deadlock.
// Sends go to whichever process holds the next segment: the swapped route's first process
// sends to the second and gets the result back.
//
// Commit. After its passes (and, under CheckFree+, once the replica's holder has the owner's
// end gradient) every process adds its loss terms and its share of the ends' squared gradient
// into one sum over the stages. A process that finished that sum knows every other process had
// finished its passes, since each had to contribute: the step has committed, and each process
// steps its own groups with what the sum gave (stage_optimizer.h). A process that lost a peer
// before the sum knows the step did not commit on any process; one that lost it inside the sum
// cannot tell, which is what the survivors settle through the store (membership.h).
#pragma once

#include <array>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/fault/stage_optimizer.h"
#include "weightlift/parallel/data/data_parallel.h"
#include "weightlift/parallel/data/step.h"
#include "weightlift/train/data.h"

namespace wl::fault {

struct RoutedStepOptions {
  parallel::StepSettings settings;  // precision, checkpointing (lr: the optimizer's)
  int micro_batches = 1;            // the global batch in this many (each of every row)
  // Micro-batch m runs its block stages in orders[m % orders.size()]: the normal order alone,
  // or CheckFree+'s normal and swapped orders.
  std::vector<std::vector<int>> orders;
};

// This process's shares of the step's sums, after its passes.
struct StepShares {
  double ce_sum = 0;  // cross-entropy summed over the targets of the micro-batches it ended
  double aux = 0, z = 0;
  double ends_sum_squares = 0;  // its share of the ends group's squared gradient
  double sum_squares = 0;       // of its whole gradient (blocks and ends)
};

// What every process knows once the step committed.
struct StepTotals {
  model::LossTerms loss;  // of the whole batch
  double ends_sum_squares = 0;
  double grad_norm = 0;  // of the whole model's gradient, before clipping
  // As five numbers, for a report to carry (membership.h): ce, aux, z, ends' and all squares.
  std::array<double, 5> to_array() const;
  static StepTotals from_array(const std::array<double, 5>& a, int64_t count);
};

// Every pass of this process (dp: its block stage and ends, one rank per stage; dp.stages()
// the stages), gradients accumulated in dp's buffers from zero; under CheckFree+, the end
// gradient sent to (or received from) the replica's holder. Collective over the stages.
Result<StepShares> run_routed_passes(parallel::DataParallel& dp, StageOptimizer& opt,
                                     const train::Batch& global, const RoutedStepOptions& o,
                                     double* waited);

// The commit: `shares` summed over the stages, in stage order (the same bits everywhere).
Result<StepTotals> commit_step(parallel::DataParallel& dp, const train::Batch& global,
                               const StepShares& shares);

}  // namespace wl::fault
