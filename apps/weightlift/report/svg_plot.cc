#include "report/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "weightlift/core/file_io.h"

namespace wl::app {
namespace {

// Ticks at 1, 2 or 5 times a power of ten, about `n` of them.
// `whole`: no step below 1 (an axis of counts).
std::vector<double> nice_ticks(double lo, double hi, int n, bool whole = false) {
  std::vector<double> t;
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / n, p = std::pow(10.0, std::floor(std::log10(raw)));
  double step = raw / p < 2 ? 2 * p : raw / p < 5 ? 5 * p : 10 * p;
  if (whole) step = std::max(step, 1.0);
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * step; v += step) {
    t.push_back(std::fabs(v) < 1e-9 * step ? 0.0 : v);  // 0, not -0 or 1e-17
  }
  return t;
}

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

// The plotted ranges (x on the log scale when asked) and the plot area inside the margins.
struct Frame {
  bool log_x = false;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  double bar_width = 1;  // the narrowest gap between two bars, in plotted x units
  double L = 70, R = 20, T = 40, B = 55, W = 0, H = 0;

  double tx(double x) const { return log_x ? std::log10(x) : x; }
  double px(double x) const { return L + (tx(x) - x0) / (x1 - x0) * W; }
  double py(double y) const { return T + (1 - (y - y0) / (y1 - y0)) * H; }
};

Frame frame_of(const std::vector<Series>& series, const PlotOptions& o) {
  Frame f;
  f.log_x = o.log_x;
  for (const Series& s : series) {
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i]) || (o.log_x && s.x[i] <= 0)) continue;
      f.x0 = std::min(f.x0, f.tx(s.x[i]));
      f.x1 = std::max(f.x1, f.tx(s.x[i]));
      f.y0 = std::min(f.y0, s.y[i]);
      f.y1 = std::max(f.y1, s.y[i]);
    }
  }
  if (!std::isfinite(f.x0)) {
    f.x0 = 0;
    f.x1 = 1;
    f.y0 = 0;
    f.y1 = 1;
  }
  // Bars stand on zero and need half a bar's room at each end.
  for (const Series& s : series) {
    if (!s.bars) continue;
    f.y0 = std::min(f.y0, 0.0);
    for (size_t i = 1; i < s.x.size(); ++i)
      f.bar_width = std::min(f.bar_width, std::fabs(f.tx(s.x[i]) - f.tx(s.x[i - 1])));
    f.x0 -= f.bar_width / 2;
    f.x1 += f.bar_width / 2;
  }
  if (f.x1 == f.x0) f.x1 = f.x0 + 1;
  if (f.y1 == f.y0) f.y1 = f.y0 + 1;
  const double pad = 0.05 * (f.y1 - f.y0);
  f.y0 -= pad;
  f.y1 += pad;
  f.W = o.width - f.L - f.R;
  f.H = o.height - f.T - f.B;
  return f;
}

// Title, grid lines with their tick labels, the frame and the axis labels.
// `plot_height`: the plot's own height, without the legend's rows below it.
void draw_axes(std::ostringstream& s, const Frame& f, const PlotOptions& o, int plot_height) {
  const double L = f.L, T = f.T, W = f.W, H = f.H;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << o.width << "' height='" << o.height
    << "' font-family='sans-serif' font-size='12'>\n"
    << "<rect width='100%' height='100%' fill='white'/>\n"
    << "<text x='" << o.width / 2 << "' y='22' text-anchor='middle' font-size='15'>"
    << escape_markup(o.title) << "</text>\n";
  for (double v : nice_ticks(f.y0, f.y1, 6)) {
    s << "<line x1='" << L << "' x2='" << L + W << "' y1='" << f.py(v) << "' y2='" << f.py(v)
      << "' stroke='#e5e5e5'/>\n<text x='" << L - 6 << "' y='" << f.py(v) + 4
      << "' text-anchor='end'>" << fmt(v) << "</text>\n";
  }
  for (double v : nice_ticks(f.x0, f.x1, 8, o.whole_x)) {
    const double xv = o.log_x ? std::pow(10.0, v) : v;
    const double X = L + (v - f.x0) / (f.x1 - f.x0) * W;
    s << "<line x1='" << X << "' x2='" << X << "' y1='" << T << "' y2='" << T + H
      << "' stroke='#eeeeee'/>\n<text x='" << X << "' y='" << T + H + 16
      << "' text-anchor='middle'>" << fmt(xv) << "</text>\n";
  }
  s << "<rect x='" << L << "' y='" << T << "' width='" << W << "' height='" << H
    << "' fill='none' stroke='#333'/>\n"
    << "<text x='" << L + W / 2 << "' y='" << plot_height - 12 << "' text-anchor='middle'>"
    << escape_markup(o.x_label) << "</text>\n"
    << "<text transform='translate(16," << T + H / 2 << ") rotate(-90)' text-anchor='middle'>"
    << escape_markup(o.y_label) << "</text>\n";
}

// One series: bars, a line, or (stacked) the band between `below` and its own y.
void draw_series(std::ostringstream& s, const Frame& f, const Series& se, const PlotOptions& o,
                 const std::vector<double>& below) {
  if (o.stacked) {
    s << "<polygon fill='" << se.color << "' fill-opacity='0.8' stroke='" << se.color
      << "' points='";
    for (size_t i = 0; i < se.x.size(); ++i) s << f.px(se.x[i]) << ',' << f.py(se.y[i]) << ' ';
    for (size_t i = se.x.size(); i-- > 0;) s << f.px(se.x[i]) << ',' << f.py(below[i]) << ' ';
    s << "'/>\n";
    return;
  }
  if (se.bars) {
    const double w = 0.8 * f.bar_width / (f.x1 - f.x0) * f.W;
    for (size_t i = 0; i < se.x.size(); ++i) {
      if (!std::isfinite(se.y[i])) continue;
      const double top = f.py(std::max(se.y[i], 0.0)), bottom = f.py(std::min(se.y[i], 0.0));
      s << "<rect x='" << f.px(se.x[i]) - w / 2 << "' y='" << top << "' width='" << w
        << "' height='" << bottom - top << "' fill='" << se.color << "'/>\n";
    }
  } else {
    s << "<polyline fill='none' stroke='" << se.color << "' stroke-width='1.6'"
      << (se.dashed ? " stroke-dasharray='6,4'" : "") << " points='";
    for (size_t i = 0; i < se.x.size(); ++i) {
      if (!std::isfinite(se.y[i]) || (o.log_x && se.x[i] <= 0)) continue;
      s << f.px(se.x[i]) << ',' << f.py(se.y[i]) << ' ';
    }
    s << "'/>\n";
  }
}

// Where each legend entry stands: left to right under the plot, a new row when the next would
// pass the right edge. Text width is estimated at 7 px a character (12 px sans-serif averages
// about 6.5), so an entry is never narrower than it draws.
struct LegendSpot {
  double x = 0, y = 0;
};
constexpr double kLegendRow = 18, kLegendSwatch = 24;

std::vector<LegendSpot> legend_layout(const std::vector<Series>& series, const Frame& f,
                                      double top) {
  std::vector<LegendSpot> spots;
  double x = f.L, y = top;
  for (const Series& se : series) {
    const double w = kLegendSwatch + 7.0 * double(se.label.size()) + 18;
    if (x > f.L && x + w > f.L + f.W) {
      x = f.L;
      y += kLegendRow;
    }
    spots.push_back({x, y});
    x += w;
  }
  return spots;
}

void draw_legend(std::ostringstream& s, const std::vector<Series>& series,
                 const std::vector<LegendSpot>& spots, const PlotOptions& o) {
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& se = series[i];
    const double x = spots[i].x, y = spots[i].y;
    if (o.stacked || se.bars) {
      s << "<rect x='" << x << "' y='" << y - 9 << "' width='" << kLegendSwatch - 6
        << "' height='10' fill='" << se.color << "'/>\n";
    } else {
      s << "<line x1='" << x << "' x2='" << x + kLegendSwatch - 6 << "' y1='" << y - 4 << "' y2='"
        << y - 4 << "' stroke='" << se.color << "' stroke-width='2'"
        << (se.dashed ? " stroke-dasharray='6,4'" : "") << "/>\n";
    }
    s << "<text x='" << x + kLegendSwatch << "' y='" << y << "'>" << escape_markup(se.label)
      << "</text>\n";
  }
}

// Stacked series as the running sums they are drawn at.
std::vector<Series> stack(const std::vector<Series>& series) {
  std::vector<Series> out = series;
  for (size_t k = 1; k < out.size(); ++k) {
    for (size_t i = 0; i < out[k].y.size() && i < out[k - 1].y.size(); ++i) {
      out[k].y[i] += std::isfinite(out[k - 1].y[i]) ? out[k - 1].y[i] : 0;
    }
  }
  return out;
}

}  // namespace

std::string svg_plot(const std::vector<Series>& given, const PlotOptions& options) {
  const std::vector<Series> series = options.stacked ? stack(given) : given;
  Frame f = frame_of(series, options);
  if (options.stacked) f.y0 = std::min(f.y0, 0.0);  // the first band stands on zero
  // The legend's rows under the x axis's label; the picture grows to hold them.
  const std::vector<LegendSpot> spots = legend_layout(series, f, options.height + 4);
  PlotOptions o = options;
  o.height += int(spots.empty() ? 0.0 : spots.back().y - options.height + 10);
  std::ostringstream s;
  draw_axes(s, f, o, options.height);
  std::vector<double> below(series.empty() ? 0 : series.front().x.size(), 0.0);
  for (const Series& se : series) {
    draw_series(s, f, se, o, below);
    if (o.stacked) below = se.y;
  }
  draw_legend(s, given, spots, o);
  s << "</svg>\n";
  return s.str();
}

std::string escape_markup(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else
      o.push_back(c);
  }
  return o;
}

Status write_svg_plot(const std::string& path, const std::vector<Series>& series,
                      const PlotOptions& o) {
  return write_file_atomically(path, svg_plot(series, o));
}

}  // namespace wl::app
