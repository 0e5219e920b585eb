// failure_schedule.h.
#include "weightlift/fault/failure_schedule.h"

#include <algorithm>

#include "weightlift/core/check.h"

namespace wl::fault {

std::vector<int> FailureSchedule::at(int64_t it) {
  WL_CHECK(it > drawn_) << "iteration " << it << " asked for after " << drawn_;
  std::vector<int> lost;
  for (; drawn_ < it; ++drawn_) {
    lost.clear();
    for (int s = 0; s < stages_; ++s) {
      if (rng_.uniform_double() < prob_) lost.push_back(s);
    }
  }
  for (const ScheduledLoss& l : scheduled_) {
    if (l.iteration == it && std::find(lost.begin(), lost.end(), l.stage) == lost.end())
      lost.push_back(l.stage);
  }
  return lost;
}

}  // namespace wl::fault
