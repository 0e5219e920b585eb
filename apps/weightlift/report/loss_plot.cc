#include "report/loss_plot.h"

#include <vector>

#include "report/svg_plot.h"
#include "weightlift/train/metrics.h"

namespace wl::app {

Status write_loss_plot(const LossPlotOptions& o) {
  WL_ASSIGN_OR_RETURN(std::vector<train::StepMetrics> records, train::read_metrics(o.metrics_path));
  Series raw{"train loss", "#9ecae1"}, smooth{"train loss (EMA)", "#08519c"},
      val{"validation loss", "#d94801"};
  Ema ema(0.95);
  for (const train::StepMetrics& m : records) {
    raw.x.push_back(double(m.step));
    raw.y.push_back(m.loss);
    smooth.x.push_back(double(m.step));
    smooth.y.push_back(ema.add(m.loss));
    if (std::isfinite(m.val_loss)) {
      val.x.push_back(double(m.step));
      val.y.push_back(m.val_loss);
    }
  }
  std::vector<Series> series{raw, smooth};
  if (!val.x.empty()) series.push_back(val);
  if (std::isfinite(o.unigram_entropy) && !raw.x.empty()) {
    series.push_back({"unigram entropy",
                      "#555555",
                      {raw.x.front(), raw.x.back()},
                      {o.unigram_entropy, o.unigram_entropy},
                      true});
  }
  return write_svg_plot(o.svg_path, series,
                        {.title = o.title, .x_label = "step", .y_label = "loss"});
}

}  // namespace wl::app
