// Learning-rate schedule: linear warmup, then cosine decay to min_lr.
//
// For the 0-based update s:
//   s <  warmup:  lr = base_lr * (s + 1) / warmup
//   s >= warmup:  lr = min_lr + (base_lr - min_lr) * (1 + cos(pi * p)) / 2,
//                 p = min(1, (s - warmup) / max(1, total - warmup))
// (tests/reference/torch_moe.py's lr_at is the same formula, written independently.)
#pragma once

#include <cmath>
#include <cstdint>

namespace wl::train {

struct LrSchedule {
  double base_lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 100;
  int64_t total_steps = 1000;

  double at(int64_t step) const {
    if (step < warmup_steps) return base_lr * double(step + 1) / double(warmup_steps);
    const double span = double(total_steps - warmup_steps > 1 ? total_steps - warmup_steps : 1);
    const double p = std::fmin(1.0, double(step - warmup_steps) / span);
    return min_lr + (base_lr - min_lr) * (1.0 + std::cos(M_PI * p)) / 2.0;
  }
};

}  // namespace wl::train
