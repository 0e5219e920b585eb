// pipeline_schedule.h.
#include "weightlift/parallel/layout/pipeline_schedule.h"

#include <algorithm>
#include <cstdio>

#include "weightlift/core/check.h"

namespace wl::parallel {

std::string_view pipeline_schedule_name(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::k1F1B:
      return "1f1b";
    case PipelineSchedule::kGPipe:
      return "gpipe";
    case PipelineSchedule::kZeroBubble:
      return "zb";
  }
  return "?";
}

std::optional<PipelineSchedule> pipeline_schedule_from_name(std::string_view name) {
  for (PipelineSchedule s :
       {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe, PipelineSchedule::kZeroBubble}) {
    if (name == pipeline_schedule_name(s)) return s;
  }
  return std::nullopt;
}

namespace {

// Slots a pass takes in the schedule's model of time: a whole backward computes twice a
// forward's FLOPs, each of its halves one forward's.
int slots(PipePass pass) { return pass == PipePass::kBackward ? 2 : 1; }

// ZB's order (pipeline_schedule.h): every pass one slot, passes started in time order, each
// stage taking the first of B, F, W that it can start soonest.
std::vector<std::vector<PipeOp>> zero_bubble_ops(int stages, int micro_batches) {
  const size_t P = size_t(stages), M = size_t(micro_batches);
  constexpr int kNotYet = -1;
  // When each stage's forward and B of each micro-batch end; kNotYet until scheduled.
  std::vector<std::vector<int>> f_end(P, std::vector<int>(M, kNotYet)), b_end = f_end;
  std::vector<int> forwards(P, 0), inputs(P, 0), weights(P, 0), free_at(P, 0);
  std::vector<std::vector<PipeOp>> ops(P);
  for (size_t left = 3 * P * M; left > 0; --left) {
    // The earliest pass any stage can start; ties go to the lower stage, then B, F, W.
    int best_stage = -1, best_start = 0;
    PipePass best_pass = PipePass::kForward;
    for (int s = 0; s < stages; ++s) {
      const size_t i = size_t(s);
      const auto consider = [&](PipePass pass, int ready) {
        const int start = std::max(free_at[i], ready);
        if (best_stage < 0 || start < best_start)
          best_stage = s, best_start = start, best_pass = pass;
      };
      if (inputs[i] < forwards[i]) {  // B: the gradient from the stage after
        const int ready = s + 1 < stages ? b_end[i + 1][size_t(inputs[i])] : 0;
        if (ready != kNotYet) consider(PipePass::kInputGrads, ready);
      }
      if (forwards[i] < micro_batches && forwards[i] - weights[i] < stages - s + 1) {
        const int ready = s > 0 ? f_end[i - 1][size_t(forwards[i])] : 0;
        if (ready != kNotYet) consider(PipePass::kForward, ready);
      }
      if (weights[i] < inputs[i]) consider(PipePass::kWeightGrads, 0);
    }
    WL_CHECK(best_stage >= 0) << "zero-bubble schedule stuck at " << stages << " stages, "
                              << micro_batches << " micro-batches";
    const size_t i = size_t(best_stage);
    const int end = best_start + 1;
    int micro_batch = 0;
    if (best_pass == PipePass::kInputGrads) {
      micro_batch = inputs[i]++;
      b_end[i][size_t(micro_batch)] = end;
    } else if (best_pass == PipePass::kForward) {
      micro_batch = forwards[i]++;
      f_end[i][size_t(micro_batch)] = end;
    } else {
      micro_batch = weights[i]++;
    }
    ops[i].push_back({best_pass, micro_batch});
    free_at[i] = end;
  }
  return ops;
}

}  // namespace

std::vector<std::vector<PipeOp>> pipeline_ops(PipelineSchedule schedule, int stages,
                                              int micro_batches) {
  WL_CHECK(stages >= 1 && micro_batches >= 1) << stages << " stages, " << micro_batches;
  if (schedule == PipelineSchedule::kZeroBubble) return zero_bubble_ops(stages, micro_batches);
  constexpr PipePass kF = PipePass::kForward, kB = PipePass::kBackward;
  std::vector<std::vector<PipeOp>> ops(static_cast<size_t>(stages));
  for (int s = 0; s < stages; ++s) {
    std::vector<PipeOp>& mine = ops[size_t(s)];
    if (schedule == PipelineSchedule::kGPipe) {
      for (int m = 0; m < micro_batches; ++m) mine.push_back({kF, m});
      for (int m = 0; m < micro_batches; ++m) mine.push_back({kB, m});
      continue;
    }
    const int warmup = std::min(stages - s - 1, micro_batches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) mine.push_back({kF, f});
    while (f < micro_batches) {
      mine.push_back({kF, f++});
      mine.push_back({kB, b++});
    }
    while (b < micro_batches) mine.push_back({kB, b++});
  }
  return ops;
}

int most_in_flight(PipelineSchedule schedule, int stages, int micro_batches, int stage) {
  WL_CHECK(stage >= 0 && stage < stages) << "stage " << stage << " of " << stages;
  if (schedule == PipelineSchedule::kGPipe) return micro_batches;
  if (schedule == PipelineSchedule::kZeroBubble) return std::min(stages - stage + 1, micro_batches);
  return std::min(stages - stage, micro_batches);  // the warmup's p - s - 1, and one more
}

namespace {

// The schedule's passes laid out in slots (slots()): each pass starts once its stage's
// previous pass has ended and the neighbour that feeds it has sent (the stage before for a
// forward, after for a backward or B; W waits for nobody).
struct Timeline {
  struct Cell {
    int at = 0, length = 0;
    std::string name;  // "F3"
  };
  std::vector<std::vector<Cell>> cells;  // per stage
  int span = 0;                          // slots until the last stage is done
  int64_t busy = 0;                      // slots the stages compute, summed
  double bubble() const { return 1.0 - double(busy) / (double(span) * double(cells.size())); }
};

Timeline lay_out(PipelineSchedule schedule, int stages, int micro_batches) {
  const auto ops = pipeline_ops(schedule, stages, micro_batches);
  std::vector<std::vector<int>> fwd_end(static_cast<size_t>(stages),
                                        std::vector<int>(static_cast<size_t>(micro_batches)));
  std::vector<std::vector<int>> bwd_end = fwd_end;
  Timeline t;
  t.cells.resize(size_t(stages));
  std::vector<size_t> next(static_cast<size_t>(stages), 0);
  std::vector<int> free_at(static_cast<size_t>(stages), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      while (next[size_t(s)] < ops[size_t(s)].size()) {
        const PipeOp op = ops[size_t(s)][next[size_t(s)]];
        const bool forward = op.pass == PipePass::kForward;
        const bool weights = op.pass == PipePass::kWeightGrads;
        int ready = free_at[size_t(s)];
        if (forward && s > 0) {
          if (fwd_end[size_t(s - 1)][size_t(op.micro_batch)] == 0) break;
          ready = std::max(ready, fwd_end[size_t(s - 1)][size_t(op.micro_batch)]);
        }
        if (!forward && !weights && s + 1 < stages) {
          if (bwd_end[size_t(s + 1)][size_t(op.micro_batch)] == 0) break;
          ready = std::max(ready, bwd_end[size_t(s + 1)][size_t(op.micro_batch)]);
        }
        const int end = ready + slots(op.pass);
        if (!weights) (forward ? fwd_end : bwd_end)[size_t(s)][size_t(op.micro_batch)] = end;
        const char* letter = forward ? "F" : weights ? "W" : "B";
        t.cells[size_t(s)].push_back(
            {ready, slots(op.pass), letter + std::to_string(op.micro_batch)});
        t.busy += slots(op.pass);
        free_at[size_t(s)] = end;
        t.span = std::max(t.span, end);
        ++next[size_t(s)];
        progress = true;
      }
    }
  }
  return t;
}

}  // namespace

double theoretical_bubble(PipelineSchedule schedule, int stages, int micro_batches) {
  if (schedule != PipelineSchedule::kZeroBubble) {
    return double(stages - 1) / double(micro_batches + stages - 1);
  }
  return lay_out(schedule, stages, micro_batches).bubble();
}

std::string print_schedule(PipelineSchedule schedule, int stages, int micro_batches) {
  const Timeline t = lay_out(schedule, stages, micro_batches);
  const int span = t.span;
  const int width = micro_batches > 10 ? 4 : 3;
  std::string out = std::string(pipeline_schedule_name(schedule)) + ", " + std::to_string(stages) +
                    " stages, " + std::to_string(micro_batches) + " micro-batches " +
                    (schedule == PipelineSchedule::kZeroBubble
                         ? "(F forward, B input gradients, W weight gradients: one slot each):\n"
                         : "(F one slot, B two):\n");
  for (int s = 0; s < stages; ++s) {
    std::vector<std::string> row(static_cast<size_t>(span),
                                 std::string(static_cast<size_t>(width), '.'));
    for (const Timeline::Cell& c : t.cells[size_t(s)]) {
      std::string text = c.name;
      text.resize(size_t(width), ' ');
      row[size_t(c.at)] = text;
      for (int i = 1; i < c.length; ++i) row[size_t(c.at + i)] = std::string(size_t(width), ' ');
    }
    char head[48];
    std::snprintf(head, sizeof head, "stage %d |", s);
    out += head;
    for (const std::string& c : row) out += c;
    out += "| at most " + std::to_string(most_in_flight(schedule, stages, micro_batches, s)) +
           " in flight\n";
  }
  char tail[160];
  std::snprintf(tail, sizeof tail,
                "bubble: %.1f%% of the stages' time idle (1F1B's (p-1)/(m+p-1) = %.1f%%)\n",
                100.0 * t.bubble(),
                100.0 * theoretical_bubble(PipelineSchedule::k1F1B, stages, micro_batches));
  return out + tail;
}

}  // namespace wl::parallel
