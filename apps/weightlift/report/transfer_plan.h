// `weightlift transfer plan`'s output: a plan (transfer/plan/planner.h) as a table for people,
// bytes per sender and per receiver. The command also prints the plan's own JSON
// (plan_to_json, docs/formats.md "Transfer plan") on request.
#pragma once

#include <string>

#include "weightlift/transfer/plan/planner.h"

namespace wl::app {

// Ranks, tasks, bytes in whole tasks and in sub-bands per sender; engine, TP rank, format and
// bytes per receiver.
std::string plan_table(const transfer::Plan& plan);

}  // namespace wl::app
