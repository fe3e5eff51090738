// Self-contained SVG line charts (no fonts, scripts or network needed to view them): several
// labelled series on shared axes with "nice" ticks, a legend that the chart widens (and
// lengthens) to fit, optional log-scale y, and labelled vertical marks (events such as a
// handoff of experts). Used by `spes plot` for loss curves and round statistics.
#pragma once
#include <string>
#include <vector>

namespace spes::report {

struct Series {
  std::string label;
  std::vector<double> x, y;  // same length; points with non-finite values are skipped
  bool markers = false;      // draw a dot at each point (sparse series such as val_loss)
};

// A dashed vertical line across the plot at x, its label written along it (class "mark").
struct ChartMark {
  double x = 0;
  std::string label;
};

struct ChartOptions {
  std::string title;
  std::string x_label;
  std::string y_label;
  int width = 820;
  int height = 460;
  bool log_y = false;
  bool integer_x = false;  // x counts things (rounds, steps, tokens): ticks at whole numbers
  std::vector<ChartMark> marks;  // drawn when inside the data's x range
};

// The chart as a complete SVG document. Fails when no series has a finite point.
std::string render_line_chart(const std::vector<Series>& series, const ChartOptions& opts);

// Up to `max_ticks` round tick values covering [lo, hi] (steps of 1, 2 or 5 x 10^k, at least
// `min_step`: 1 for axes that count things).
std::vector<double> nice_ticks(double lo, double hi, int max_ticks, double min_step = 0);

// The width in px that a legend label of 12 px sans-serif takes at most (a bound for the
// widest common glyphs, so that a legend sized by it is never cut).
double legend_text_width(const std::string& label);

// A compact label for a tick value: 1.2M, 400k, 3.5, 0.02.
std::string tick_label(double v);

}  // namespace spes::report
