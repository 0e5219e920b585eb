// pipeline_schedule.h.
#include "weightlift/parallel/pipeline_schedule.h"

#include <algorithm>
#include <cstdio>

#include "weightlift/core/check.h"

namespace wl::parallel {

std::string_view pipeline_schedule_name(PipelineSchedule s) {
  return s == PipelineSchedule::k1F1B ? "1f1b" : "gpipe";
}

std::optional<PipelineSchedule> pipeline_schedule_from_name(std::string_view name) {
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  return std::nullopt;
}

std::vector<std::vector<PipeOp>> pipeline_ops(PipelineSchedule schedule, int stages,
                                              int micro_batches) {
  WL_CHECK(stages >= 1 && micro_batches >= 1) << stages << " stages, " << micro_batches;
  std::vector<std::vector<PipeOp>> ops(static_cast<size_t>(stages));
  for (int s = 0; s < stages; ++s) {
    std::vector<PipeOp>& mine = ops[size_t(s)];
    if (schedule == PipelineSchedule::kGPipe) {
      for (int m = 0; m < micro_batches; ++m) mine.push_back({true, m});
      for (int m = 0; m < micro_batches; ++m) mine.push_back({false, m});
      continue;
    }
    const int warmup = std::min(stages - s - 1, micro_batches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) mine.push_back({true, f});
    while (f < micro_batches) {
      mine.push_back({true, f++});
      mine.push_back({false, b++});
    }
    while (b < micro_batches) mine.push_back({false, b++});
  }
  return ops;
}

double theoretical_bubble(int stages, int micro_batches) {
  return double(stages - 1) / double(micro_batches + stages - 1);
}

int most_in_flight(PipelineSchedule schedule, int stages, int micro_batches, int stage) {
  WL_CHECK(stage >= 0 && stage < stages) << "stage " << stage << " of " << stages;
  if (schedule == PipelineSchedule::kGPipe) return micro_batches;
  return std::min(stages - stage, micro_batches);  // the warmup's p - s - 1, and one more
}

std::string print_schedule(PipelineSchedule schedule, int stages, int micro_batches) {
  const auto ops = pipeline_ops(schedule, stages, micro_batches);
  // Start slots, forward 1 slot, backward 2: each pass waits for its stage's previous pass and
  // for the neighbour that feeds it (the stage before for a forward, after for a backward).
  std::vector<std::vector<int>> fwd_end(static_cast<size_t>(stages),
                                        std::vector<int>(static_cast<size_t>(micro_batches)));
  std::vector<std::vector<int>> bwd_end = fwd_end;
  std::vector<std::vector<std::pair<int, std::string>>> cells(static_cast<size_t>(stages));
  std::vector<size_t> next(static_cast<size_t>(stages), 0);
  std::vector<int> free_at(static_cast<size_t>(stages), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      while (next[size_t(s)] < ops[size_t(s)].size()) {
        const PipeOp op = ops[size_t(s)][next[size_t(s)]];
        int ready = free_at[size_t(s)];
        if (op.forward && s > 0) {
          if (fwd_end[size_t(s - 1)][size_t(op.micro_batch)] == 0) break;
          ready = std::max(ready, fwd_end[size_t(s - 1)][size_t(op.micro_batch)]);
        }
        if (!op.forward && s + 1 < stages) {
          if (bwd_end[size_t(s + 1)][size_t(op.micro_batch)] == 0) break;
          ready = std::max(ready, bwd_end[size_t(s + 1)][size_t(op.micro_batch)]);
        }
        const int end = ready + (op.forward ? 1 : 2);
        (op.forward ? fwd_end : bwd_end)[size_t(s)][size_t(op.micro_batch)] = end;
        cells[size_t(s)].push_back(
            {ready, (op.forward ? "F" : "B") + std::to_string(op.micro_batch)});
        free_at[size_t(s)] = end;
        ++next[size_t(s)];
        progress = true;
      }
    }
  }
  const int span = *std::max_element(free_at.begin(), free_at.end());
  const int width = micro_batches > 10 ? 4 : 3;
  std::string out = std::string(pipeline_schedule_name(schedule)) + ", " + std::to_string(stages) +
                    " stages, " + std::to_string(micro_batches) +
                    " micro-batches (F one slot, B two):\n";
  int busy = 0;
  for (int s = 0; s < stages; ++s) {
    std::vector<std::string> row(static_cast<size_t>(span),
                                 std::string(static_cast<size_t>(width), '.'));
    for (const auto& [at, name] : cells[size_t(s)]) {
      std::string text = name;
      text.resize(size_t(width), ' ');
      row[size_t(at)] = text;
      if (name[0] == 'B') row[size_t(at + 1)] = std::string(size_t(width), ' ');
      busy += name[0] == 'B' ? 2 : 1;
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
                "bubble: %.1f%% of the stages' time idle (theory (p-1)/(m+p-1) = %.1f%%)\n",
                100.0 * (1.0 - double(busy) / double(span * stages)),
                100.0 * theoretical_bubble(stages, micro_batches));
  return out + tail;
}

}  // namespace wl::parallel
