// What an RL job's options must fit before any process connects (loop.h's check_layouts and
// check_memory), and the task every trainer rank makes once they do.
#pragma once

#include <cstdint>

#include "weightlift/core/status.h"
#include "weightlift/rl/loop.h"
#include "weightlift/rl/tasks.h"

namespace wl::rl {

// Tokens a completion may take: the longest answer and its end token (a generation's max_new).
int64_t completion_tokens(const Task& task);
// Positions a sample needs: the prompt (its special tokens included) and its completion.
int64_t sample_positions(const Task& task);

// The task of `options`, once they are known to fit the trainer's ranks and the memory:
// checked on every trainer rank before any connects. The task is made once (a tokenizer's file
// is read and every dataset row encoded) and checked as it is.
Result<Task> trainer_task(const RlOptions& options);

}  // namespace wl::rl
