// SVG line charts (see svg_chart.h).
#include "spes/report/svg_chart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "spes/common/error.h"

namespace spes::report {

namespace {

const char* const kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

bool usable(double x, double y, bool log_y) {
  return std::isfinite(x) && std::isfinite(y) && (!log_y || y > 0);
}


// Where values land on the page: the data's ranges (y on the log scale when asked) and the
// plot area inside the margins.
struct Axes {
  bool log_y = false;
  bool integer_x = false;
  double x0 = 0, x1 = 0;    // x range
  double y0 = 0, y1 = 0;    // y range of the data
  double ly0 = 0, ly1 = 0;  // y range drawn: padded, log10 on a log scale
  int left = 78, right = 190, top = 42, bottom = 56;  // margins (px); right holds the legend
  double pw = 0, ph = 0;    // plot area (px)
  int width = 0, height = 0;  // the whole chart (px): the options' size, grown for the legend

  double fy(double y) const { return log_y ? std::log10(y) : y; }
  double px(double x) const { return left + (x - x0) / (x1 - x0) * pw; }
  double py(double y) const { return top + (1 - (fy(y) - ly0) / (ly1 - ly0)) * ph; }
};

constexpr int kLegendRow = 18;     // px between legend rows
constexpr int kLegendText = 38;    // px from the plot's right edge to a legend label
constexpr int kLegendPadding = 12; // px right of the longest label

// Widens the right margin (and so the chart) until the longest legend label fits, and lengthens
// the plot until every legend row fits beside it.
void fit_legend(const std::vector<Series>& series, Axes& a) {
  double widest = 0;
  int rows = 0;
  for (const auto& s : series) {
    widest = std::max(widest, legend_text_width(s.label));
    ++rows;
  }
  a.right = std::max(a.right, static_cast<int>(std::ceil(kLegendText + widest + kLegendPadding)));
  a.ph = std::max(a.ph, static_cast<double>(10 + kLegendRow * rows));
  a.width = static_cast<int>(a.left + a.pw) + a.right;
  a.height = static_cast<int>(std::ceil(a.top + a.ph)) + a.bottom;
}

// The axes that hold every usable point of every series, the y range padded by 4% (or by 0.5
// around a single value), in a chart large enough for the legend.
Axes axes_for(const std::vector<Series>& series, const ChartOptions& o) {
  Axes a;
  a.log_y = o.log_y;
  a.integer_x = o.integer_x;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series) {
    SPES_CHECK(s.x.size() == s.y.size(), "chart series '{}': {} x values but {} y values",
               s.label, s.x.size(), s.y.size());
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.x[i], s.y[i], o.log_y)) continue;
      x0 = std::min(x0, s.x[i]);
      x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, s.y[i]);
      y1 = std::max(y1, s.y[i]);
    }
  }
  SPES_CHECK(std::isfinite(x0), "chart '{}': no series has a finite point to draw", o.title);
  a.x0 = x0;
  a.x1 = x1 <= x0 ? x0 + 1 : x1;
  a.y0 = y0;
  a.y1 = y1;
  a.ly0 = a.fy(y0);
  a.ly1 = a.fy(y1);
  if (a.ly1 <= a.ly0) {
    a.ly0 -= 0.5;
    a.ly1 += 0.5;
  } else {
    const double pad = 0.04 * (a.ly1 - a.ly0);
    a.ly0 -= pad;
    a.ly1 += pad;
  }
  a.pw = o.width - a.left - a.right;
  a.ph = o.height - a.top - a.bottom;
  fit_legend(series, a);
  return a;
}

// The SVG element with a white background and the title.
std::string chart_header(const ChartOptions& o, const Axes& a) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"15\" font-weight=\"bold\">{3}</text>\n",
      a.width, a.height, a.left, xml_escape(o.title));
}

// Vertical grid lines with their tick labels below the plot.
std::string x_grid(const Axes& a) {
  std::string svg;
  for (double t : nice_ticks(a.x0, a.x1, 8, a.integer_x ? 1 : 0)) {
    if (t < a.x0 || t > a.x1) continue;
    svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" "
                       "stroke=\"#e5e5e5\"/>\n<text x=\"{0:.1f}\" y=\"{3:.1f}\" "
                       "text-anchor=\"middle\">{4}</text>\n",
                       a.px(t), a.top, a.top + a.ph, a.top + a.ph + 16, tick_label(t));
  }
  return svg;
}

// The y ticks: on a log scale 1, 2 and 5 x 10^k inside the range (nice linear ticks when
// fewer than two fit), else nice linear ticks.
std::vector<double> y_ticks(const Axes& a) {
  if (!a.log_y) return nice_ticks(a.ly0, a.ly1, 7);
  std::vector<double> yt;
  for (double e = std::floor(a.ly0); e <= std::ceil(a.ly1); e += 1)
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = m * std::pow(10.0, e);
      if (a.fy(v) >= a.ly0 && a.fy(v) <= a.ly1) yt.push_back(v);
    }
  if (yt.size() < 2) yt = nice_ticks(a.y0, a.y1, 6);
  return yt;
}

// Horizontal grid lines with their tick labels left of the plot.
std::string y_grid(const Axes& a) {
  std::string svg;
  for (double t : y_ticks(a)) {
    if (a.log_y && t <= 0) continue;
    const double y = a.py(t);
    if (y < a.top - 0.5 || y > a.top + a.ph + 0.5) continue;
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" "
                       "stroke=\"#e5e5e5\"/>\n<text x=\"{3}\" y=\"{4:.1f}\" "
                       "text-anchor=\"end\">{5}</text>\n",
                       a.left, y, a.left + a.pw, a.left - 6, y + 4, tick_label(t));
  }
  return svg;
}

// The plot's frame and the axis labels.
std::string frame_and_labels(const ChartOptions& o, const Axes& a) {
  std::string svg = fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{:.1f}\" height=\"{:.1f}\" "
                                "fill=\"none\" stroke=\"#444\"/>\n",
                                a.left, a.top, a.pw, a.ph);
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                     a.left + a.pw / 2, a.height - 12, xml_escape(o.x_label));
  svg += fmt::format("<text transform=\"translate(18,{:.1f}) rotate(-90)\" "
                     "text-anchor=\"middle\">{}</text>\n",
                     a.top + a.ph / 2, xml_escape(o.y_label + (o.log_y ? " (log scale)" : "")));
  return svg;
}

// Each series with a usable point as a line (dots at its points when asked), in palette
// order, and its entry in the legend right of the plot.
std::string series_and_legend(const std::vector<Series>& series, const Axes& a) {
  std::string svg;
  int legend_row = 0;
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    const char* color = kPalette[k % (sizeof(kPalette) / sizeof(kPalette[0]))];
    std::string points;
    std::string dots;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!usable(s.x[i], s.y[i], a.log_y)) continue;
      points += fmt::format("{:.1f},{:.1f} ", a.px(s.x[i]), a.py(s.y[i]));
      if (s.markers)
        dots += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.8\" fill=\"{}\"/>\n",
                            a.px(s.x[i]), a.py(s.y[i]), color);
    }
    if (points.empty()) continue;
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\" "
                       "points=\"{}\"/>\n{}",
                       color, points, dots);
    const double ly = a.top + 10 + kLegendRow * legend_row++;
    svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" "
                       "stroke=\"{3}\" stroke-width=\"3\"/>\n<text x=\"{4:.1f}\" y=\"{5:.1f}\">"
                       "{6}</text>\n",
                       a.left + a.pw + 12, ly, a.left + a.pw + 32, color,
                       a.left + a.pw + kLegendText, ly + 4, xml_escape(s.label));
  }
  return svg;
}

// The marks inside the x range: a dashed grey line over the plot's height, the label rotated
// along it, just right of the line, reading upwards from the plot's bottom.
std::string marks_svg(const std::vector<ChartMark>& marks, const Axes& a) {
  std::string svg;
  for (const auto& m : marks) {
    if (!std::isfinite(m.x) || m.x < a.x0 || m.x > a.x1) continue;
    const double x = a.px(m.x);
    svg += fmt::format("<g class=\"mark\"><line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" "
                       "y2=\"{2:.1f}\" stroke=\"#555\" stroke-width=\"1.2\" "
                       "stroke-dasharray=\"5 3\"/><text transform=\"translate({3:.1f},{4:.1f}) "
                       "rotate(-90)\" font-size=\"11\" fill=\"#333\">{5}</text></g>\n",
                       x, a.top, a.top + a.ph, x + 12, a.top + a.ph - 6, xml_escape(m.label));
  }
  return svg;
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int max_ticks, double min_step) {
  if (!(hi > lo)) return {lo};
  const double raw = std::max((hi - lo) / std::max(1, max_ticks - 1), min_step);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * mag;
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step)
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

double legend_text_width(const std::string& label) {
  // Advance widths in em of DejaVu Sans (the usual sans-serif on Linux) and Arial, rounded up:
  // m, w, M, W, @ and % are the widest; other capitals up to 0.8; digits, lower case and
  // punctuation up to 0.65; a character outside ASCII counts as a full em.
  constexpr double kFontPx = 12;
  double em = 0;
  for (size_t i = 0; i < label.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(label[i]);
    if (c >= 0x80) {
      if ((c & 0xC0) != 0x80) em += 1.0;  // the first byte of a UTF-8 character
    } else if (std::string_view("mwMW@%").find(static_cast<char>(c)) != std::string_view::npos) {
      em += 1.0;
    } else if (c >= 'A' && c <= 'Z') {
      em += 0.8;
    } else {
      em += 0.65;
    }
  }
  return em * kFontPx;
}

std::string tick_label(double v) {
  const double a = std::abs(v);
  auto trim = [](std::string s) {
    if (s.find('.') != std::string::npos) {
      while (!s.empty() && s.back() == '0') s.pop_back();
      if (!s.empty() && s.back() == '.') s.pop_back();
    }
    return s;
  };
  if (a >= 1e9) return trim(fmt::format("{:.2f}", v / 1e9)) + "G";
  if (a >= 1e6) return trim(fmt::format("{:.2f}", v / 1e6)) + "M";
  if (a >= 1e4) return trim(fmt::format("{:.1f}", v / 1e3)) + "k";
  if (a >= 100 || a == 0) return trim(fmt::format("{:.0f}", v));
  if (a >= 1) return trim(fmt::format("{:.2f}", v));
  return trim(fmt::format("{:.4f}", v));
}

std::string render_line_chart(const std::vector<Series>& series, const ChartOptions& o) {
  const Axes a = axes_for(series, o);
  return chart_header(o, a) + x_grid(a) + y_grid(a) + frame_and_labels(o, a) +
         series_and_legend(series, a) + marks_svg(o.marks, a) + "</svg>\n";
}

}  // namespace spes::report
