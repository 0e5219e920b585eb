// recovery.h.
#include "weightlift/fault/recovery.h"

#include <algorithm>
#include <string>

#include "weightlift/core/check.h"

namespace wl::fault {

std::string_view recovery_name(Recovery r) {
  switch (r) {
    case Recovery::kNone:
      return "none";
    case Recovery::kCheckpoint:
      return "checkpoint";
    case Recovery::kCheckFree:
      return "checkfree";
    case Recovery::kCheckFreePlus:
      return "checkfree+";
  }
  return "?";
}

Result<Recovery> parse_recovery(std::string_view name) {
  for (Recovery r :
       {Recovery::kNone, Recovery::kCheckpoint, Recovery::kCheckFree, Recovery::kCheckFreePlus}) {
    if (recovery_name(r) == name) return r;
  }
  return invalid_argument("unknown recovery '" + std::string(name) +
                          "': expected one of none, checkpoint, checkfree, checkfree+");
}

Status check_recovery_layout(Recovery r, int stages) {
  if (stages < 1) return invalid_argument("a pipeline needs at least one stage");
  if (r == Recovery::kCheckFree && stages < 3) {
    return invalid_argument(
        "checkfree rebuilds a stage from its two neighbours and needs at "
        "least 3 stages, the pipeline has " +
        std::to_string(stages));
  }
  if (r == Recovery::kCheckFreePlus && stages < 4) {
    return invalid_argument(
        "checkfree+ swaps the first two and the last two stages and needs at "
        "least 4 stages, the pipeline has " +
        std::to_string(stages));
  }
  return ok_status();
}

std::string_view rebuild_kind_name(Rebuild::Kind k) {
  switch (k) {
    case Rebuild::Kind::kAverage:
      return "average";
    case Rebuild::Kind::kCopy:
      return "copy";
    case Rebuild::Kind::kFresh:
      return "fresh";
    case Rebuild::Kind::kRollback:
      return "rollback";
  }
  return "?";
}

namespace {

// The stage whose position stage s trains on in checkfree+'s swapped micro-batches, or -1.
int swap_partner(int s, int stages) {
  if (s == 0) return 1;
  if (s == 1) return 0;
  if (s == stages - 1) return stages - 2;
  if (s == stages - 2) return stages - 1;
  return -1;
}

}  // namespace

Result<std::vector<Rebuild>> plan_recovery(Recovery r, int stages, std::span<const int> lost) {
  WL_RETURN_IF_ERROR(check_recovery_layout(r, stages));
  std::vector<int> order(lost.begin(), lost.end());
  std::sort(order.begin(), order.end());
  std::vector<bool> gone(size_t(stages), false);
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] < 0 || order[i] >= stages) {
      return invalid_argument("lost stage " + std::to_string(order[i]) + " of a pipeline of " +
                              std::to_string(stages) + " stages");
    }
    if (i > 0 && order[i] == order[i - 1])
      return invalid_argument("stage " + std::to_string(order[i]) + " is listed lost twice");
    gone[size_t(order[i])] = true;
  }
  std::vector<Rebuild> plan;
  if (order.empty()) return plan;
  const bool from_neighbours = r == Recovery::kCheckFree || r == Recovery::kCheckFreePlus;
  if (from_neighbours && int(order.size()) == stages) {
    return failed_precondition("all " + std::to_string(stages) +
                               " stages were lost at once: nothing is left to rebuild from");
  }
  for (int s : order) {
    Rebuild b{.stage = s};
    if (r == Recovery::kCheckpoint) {
      b.kind = Rebuild::Kind::kRollback;
    } else if (r == Recovery::kNone) {
      b.kind = Rebuild::Kind::kFresh;
    } else {
      const int partner = r == Recovery::kCheckFreePlus ? swap_partner(s, stages) : -1;
      if (partner >= 0 && !gone[size_t(partner)]) {
        b.kind = Rebuild::Kind::kCopy;
        b.left = partner;
      } else {
        int left = s - 1, right = s + 1;
        while (left >= 0 && gone[size_t(left)]) --left;
        while (right < stages && gone[size_t(right)]) ++right;
        if (left >= 0 && right < stages) {
          b.kind = Rebuild::Kind::kAverage;
          b.left = left;
          b.right = right;
        } else {
          b.kind = Rebuild::Kind::kCopy;
          b.left = left >= 0 ? left : right;
        }
      }
    }
    plan.push_back(b);
  }
  return plan;
}

void average_neighbours(std::span<const float> left, double left_norm, std::span<const float> right,
                        double right_norm, std::span<float> out) {
  WL_CHECK(left.size() == right.size() && out.size() == left.size())
      << left.size() << " " << right.size() << " " << out.size();
  WL_CHECK(left_norm >= 0 && right_norm >= 0) << left_norm << " " << right_norm;
  const double wl = left_norm + kNormEpsilon, wr = right_norm + kNormEpsilon;
  const double total = wl + wr;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = float((wl * double(left[i]) + wr * double(right[i])) / total);
  }
}

}  // namespace wl::fault
