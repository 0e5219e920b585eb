// Line plots as standalone SVG files: no plotting library needed to see a loss curve.
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
};

struct PlotOptions {
  std::string title;
  std::string x_label, y_label;
  bool log_x = false;
  int width = 800, height = 480;
};

Status write_svg_plot(const std::string& path, const std::vector<Series>& series,
                      const PlotOptions& opts);

}  // namespace wl::app
