// A pipeline's schedule as data: for every stage, the forward and backward passes of the
// micro-batches in the order it runs them. Two schedules:
//
//   GPipe   every forward, then every backward (micro-batches in order both times): simple,
//           but a stage keeps all m micro-batches' activations until its backward starts.
//   1F1B    PipeDream-flush: stage s runs p - s - 1 forwards to fill the pipe, then alternates
//           one forward and one backward, then drains the backwards: at most p - s micro-batches
//           are in flight on stage s, whatever m is, so activation memory stops growing with m.
//
// Both idle each stage for the same (p - 1) forward+backward slots per step: with equal
// forward and backward times the bubble is (p - 1) / (m + p - 1) of the step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace wl::parallel {

enum class PipelineSchedule : uint8_t { k1F1B, kGPipe };
std::string_view pipeline_schedule_name(PipelineSchedule s);  // "1f1b", "gpipe"
std::optional<PipelineSchedule> pipeline_schedule_from_name(std::string_view name);

struct PipeOp {
  bool forward = true;
  int micro_batch = 0;
};

// ops[s]: stage s's passes in order.
std::vector<std::vector<PipeOp>> pipeline_ops(PipelineSchedule schedule, int stages,
                                              int micro_batches);

// The most micro-batches stage `stage` holds activations for at once (forwards whose backward
// has not run yet): m under GPipe, min(p - s, m) under 1F1B. Closed form, so a plan of
// thousands of stages and a million micro-batches costs nothing.
int most_in_flight(PipelineSchedule schedule, int stages, int micro_batches, int stage);

// The theoretical bubble: (p - 1) / (m + p - 1).
double theoretical_bubble(int stages, int micro_batches);

// A per-stage timeline of the schedule with every forward taking one slot and every backward
// two (a backward computes twice the FLOPs): "F3" a forward of micro-batch 3, "B3" a backward
// (two columns), "." idle. The maximum number of micro-batches in flight on each stage too.
std::string print_schedule(PipelineSchedule schedule, int stages, int micro_batches);

}  // namespace wl::parallel
