// A recovery's transfers on the new epoch's group (trainer.h): the lost stages brought back by
// the plan (recovery.h) from the survivors beside them, and under CheckFree+ the replicas of
// the ends, taken whole.
//
//   rebuild        Every survivor a lost stage is rebuilt from posts its blocks and their
//                  last post-clip gradient norm; each lost stage receives and becomes their
//                  average weighted by those norms (average_neighbours), a copy of one, or
//                  fresh weights, and its blocks group starts afresh (zero moments, step 0,
//                  lr x lr_scale). Under CheckFree+ a lost end's owner then takes the end's
//                  state back from its replica's holder, and a lost holder the replica from
//                  the owner.
//   sync_replicas  After a start or a rollback, every CheckFree+ replica takes its owner's end
//                  unit whole; from then on the step keeps them equal.
//
// An object lives for one recovery: the group is the new epoch's.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/comm/group/group.h"
#include "weightlift/core/status.h"
#include "weightlift/fault/membership.h"
#include "weightlift/fault/recovery.h"
#include "weightlift/fault/stage_optimizer.h"
#include "weightlift/parallel/data/data_parallel.h"

namespace wl::fault {

class StageRebuild {
 public:
  struct Options {
    Recovery recovery = Recovery::kCheckFree;
    double lr_scale = 1;
    uint64_t seed = 0;  // the run's: a fresh stage's weights are drawn from it (fresh_stage_seed)
    std::chrono::milliseconds timeout{60000};
    std::string dump_dir;  // ResilienceOptions::rebuild_dump
  };

  // This process's stage `stage` of `stages`: its optimizer and parameters, borrowed.
  StageRebuild(comm::Group& group, StageOptimizer& opt, parallel::DataParallel& dp, int stage,
               int stages, Options options)
      : group_(group), opt_(opt), dp_(dp), stage_(stage), stages_(stages), o_(std::move(options)) {}

  // Collective over the new epoch: every stage of `d` takes part, lost or not.
  Status rebuild(const Decision& d, const std::vector<Rebuild>& plan);
  Status sync_replicas();

 private:
  struct Sends;
  Status post_sends(const Decision& d, const std::vector<Rebuild>& plan, Sends& out);
  Status receive_blocks(const Decision& d, const Rebuild& b);
  Status receive_end_state();
  Status dump(const Decision& d, const Rebuild& b, std::array<double, 2> norms);

  comm::Group& group_;
  StageOptimizer& opt_;
  parallel::DataParallel& dp_;
  int stage_, stages_;
  Options o_;
  std::array<double, 2> received_norms_{0, 0};  // of the neighbours this stage came back from
};

}  // namespace wl::fault
