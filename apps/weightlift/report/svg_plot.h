// Line, bar and stacked-area plots as SVG, standalone files or text to inline in an HTML report:
// no plotting library needed to see a loss curve. The legend stands below the plot, in as many
// rows as its entries need, so that no label is clipped and none covers a curve.
#pragma once

#include <string>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::app {

struct Series {
  std::string label;
  std::string color;  // CSS colour
  std::vector<double> x, y;
  bool dashed = false;
  bool bars = false;  // one bar per point, from the axis's bottom (histograms)
};

struct PlotOptions {
  std::string title;
  std::string x_label, y_label;
  bool log_x = false;
  bool whole_x = false;  // x ticks at whole numbers only (counts, versions)
  // Each series stacked on the ones before it, filled (parts of a whole: the phases of a step).
  // The series share their x.
  bool stacked = false;
  int width = 800, height = 480;  // the plot's; the legend below it adds rows as it needs
};

std::string svg_plot(const std::vector<Series>& series, const PlotOptions& opts);
// Text as it may stand in SVG or HTML: <, > and & as entities.
std::string escape_markup(const std::string& s);
Status write_svg_plot(const std::string& path, const std::vector<Series>& series,
                      const PlotOptions& opts);

}  // namespace wl::app
