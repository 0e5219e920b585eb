// Flags that `weightlift fault simulate` and `weightlift train --recovery` share.
#pragma once

#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/fault/failure_schedule.h"

namespace wl::app {

// --kill ITERATION:STAGE (repeatable): stages lost by hand at the start of given iterations;
// `flag` names the flag in errors ("--kill", "--freeze").
Result<std::vector<fault::ScheduledLoss>> parse_kills(const std::vector<std::string>& kills,
                                                      const std::string& flag = "--kill");

}  // namespace wl::app
