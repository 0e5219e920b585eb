// The loss curve of a training run, drawn from its metrics.jsonl (train/metrics.h): the raw
// loss, its moving average, the validation loss and, for a corpus, the unigram entropy as a
// dashed line to beat. A resumed run's file holds the whole curve, so the plot does too.
#pragma once

#include <cmath>
#include <string>

#include "weightlift/core/status.h"

namespace wl::app {

// Exponential moving average with bias correction (as Adam corrects its moments), so the
// first points are not dragged towards zero.
class Ema {
 public:
  explicit Ema(double decay) : decay_(decay) {}
  double add(double x) {
    sum_ = decay_ * sum_ + (1 - decay_) * x;
    weight_ = decay_ * weight_ + (1 - decay_);
    return value();
  }
  double value() const { return weight_ > 0 ? sum_ / weight_ : NAN; }

 private:
  double decay_, sum_ = 0, weight_ = 0;
};

struct LossPlotOptions {
  std::string metrics_path;  // metrics.jsonl
  std::string svg_path;      // written atomically
  std::string title;
  double unigram_entropy = NAN;  // nats per byte; NaN: no such line
};

// DataLoss for a damaged metrics file (read_metrics); the write's error otherwise.
Status write_loss_plot(const LossPlotOptions& options);

}  // namespace wl::app
