#include "fault_flags.h"

#include "validate.h"

namespace wl::app {

Result<std::vector<fault::ScheduledLoss>> parse_kills(const std::vector<std::string>& kills,
                                                      const std::string& flag) {
  std::vector<fault::ScheduledLoss> out;
  for (const std::string& k : kills) {
    const size_t colon = k.find(':');
    if (colon == std::string::npos)
      return invalid_argument(flag + " '" + k + "': expected ITERATION:STAGE, e.g. 120:2");
    WL_ASSIGN_OR_RETURN(const int64_t it, parse_count(flag, k.substr(0, colon), 1, kMaxSteps));
    WL_ASSIGN_OR_RETURN(const int64_t st, parse_count(flag, k.substr(colon + 1), 0, 1 << 20));
    out.push_back({it, int(st)});
  }
  return out;
}

}  // namespace wl::app
