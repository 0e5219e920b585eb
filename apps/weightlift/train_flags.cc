#include "train_flags.h"

#include <utility>

#include "validate.h"

namespace wl::app {

void add_train_flag_ranges(CLI::App& train) {
  const std::pair<const char*, CLI::Validator> ranges[] = {
      {"--seed", u64()},
      {"--batch", count(1, kMaxRows)},
      {"--seq", count(0, kMaxRows)},  // 0: the config's max_seq_len
      // 0 would drop every token, and an infinite one is dropless: leave the flag out.
      {"--capacity-factor", real(kPositive)},
      {"--micro-batches", count(1, kMaxRows)},
      {"--pp", count(1, kMaxRanks)},
      {"--ep", count(1, kMaxRanks)},
      {"--tp", count(1, kMaxRanks)},
      {"--bucket-bytes", bytes(1, kTiB)},
      // A timeout of 0 or less would not be one.
      {"--timeout", real({.lo = 0, .hi = double(kMaxSeconds), .lo_open = true})},
      {"--die-at-step", count(0, kMaxSteps)},
      {"--die-rank", count(0, kMaxRanks)},
      {"--steps", count(1, kMaxSteps)},
      // A rate of 0 trains nothing and a negative one climbs the loss.
      {"--lr", real(kPositive)},
      {"--min-lr", real(kNonNegative)},
      {"--warmup-steps", count(0, kMaxSteps)},
      // beta = 1 never forgets the first gradient; v would never be a mean of squares.
      {"--beta1", real(kBeta)},
      {"--beta2", real(kBeta)},
      // eps = 0 divides by zero where a parameter's gradient has always been zero.
      {"--adam-eps", real(kPositive)},
      {"--weight-decay", real(kNonNegative)},
      {"--grad-clip", real(kNonNegative)},  // 0: off
      {"--eval-every", count(0, kMaxSteps)},
      {"--eval-windows", count(0, kMaxRows)},
      {"--checkpoint-every", count(0, kMaxSteps)},
      {"--stop-after", count(0, kMaxSteps)},
      {"--lr-scale", real(kPositive)},
      {"--fail-prob", real({.lo = 0, .hi = 1})},
      {"--fail-seed", u64()},
  };
  for (const auto& [flag, validator] : ranges) train.get_option(flag)->transform(validator);
}

}  // namespace wl::app
