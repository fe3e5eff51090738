// The progress view of `spes launch` (see launch_view.h).
#include "spes/cluster/launch_view.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include "spes/common/error.h"
#include "spes/train/metrics.h"

namespace spes {
namespace {
using Clock = std::chrono::steady_clock;

constexpr double kLiveRedrawS = 0.2;  // at most five frames a second
constexpr size_t kLiveNodeRows = 16;  // more nodes: the rest in one row

// The terminal's width (80 when it does not say).
size_t terminal_columns(std::FILE* out) {
  winsize ws{};
  if (::ioctl(::fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 10) return ws.ws_col;
  return 80;
}

// "12/300": a count out of its total, or the count alone when the total is unknown.
std::string out_of(int64_t n, int64_t total) {
  return total > 0 ? fmt::format("{}/{}", n, total) : std::to_string(n);
}

std::string bar(int64_t step, int64_t total) {
  constexpr int kWidth = 20;
  const int filled = total > 0 ? static_cast<int>(kWidth * std::clamp<int64_t>(step, 0, total) /
                                                  total)
                               : 0;
  return "[" + std::string(static_cast<size_t>(filled), '#') +
         std::string(static_cast<size_t>(kWidth - filled), '-') + "]";
}

// What a part without a step shows: how it ended, or its last event.
std::string state_text(const PartStatus& st) {
  if (st.exited) return st.code == 0 ? "done" : fmt::format("exited with code {}", st.code);
  return st.last_event.empty() ? "starting" : st.last_event;
}

// The nodes with a step so far.
std::vector<const PartStatus*> stepping_nodes(const std::vector<PartStatus>& status) {
  std::vector<const PartStatus*> v;
  for (size_t k = 1; k < status.size(); ++k)
    if (status[k].step >= 0) v.push_back(&status[k]);
  return v;
}
}  // namespace

LaunchViewMode launch_view_mode_from_string(const std::string& s) {
  if (s == "auto") return LaunchViewMode::Auto;
  if (s == "live") return LaunchViewMode::Live;
  if (s == "plain") return LaunchViewMode::Plain;
  if (s == "all") return LaunchViewMode::All;
  fail("--progress must be auto, live, plain or all, found '{}'", s);
}

LaunchViewMode resolve_launch_view_mode(LaunchViewMode mode, std::FILE* out) {
  if (mode != LaunchViewMode::Auto) return mode;
  const char* term = std::getenv("TERM");
  const bool dumb = term != nullptr && std::string(term) == "dumb";
  return ::isatty(::fileno(out)) && !dumb ? LaunchViewMode::Live : LaunchViewMode::Plain;
}

LaunchView::LaunchView(LaunchViewMode mode, const std::vector<std::string>& parts,
                       int64_t total_rounds, double plain_every_s, std::FILE* out)
    : mode_(resolve_launch_view_mode(mode, out)),
      names_(parts),
      status_(parts.size()),
      total_rounds_(total_rounds),
      plain_every_s_(plain_every_s),
      out_(out) {
  if (!status_.empty()) status_[0].is_server = true;
  start_ = last_draw_ = Clock::now();
}

double LaunchView::elapsed_s() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void LaunchView::line(size_t k, const std::string& text) {
  const bool show = update_part_status(status_[k], text);
  dirty_ = true;
  if (mode_ == LaunchViewMode::All) {
    std::fprintf(out_, "[%s] %s\n", names_[k].c_str(), text.c_str());
    std::fflush(out_);
  } else if (show) {
    print_above(fmt::format("[{}] {}", names_[k], text));
  }
}

void LaunchView::exited(size_t k, int code) {
  status_[k].exited = true;
  status_[k].code = code;
  dirty_ = true;
}

void LaunchView::message(const std::string& text) { print_above(text); }

void LaunchView::print_above(const std::string& text) {
  if (mode_ == LaunchViewMode::Live && drawn_ > 0 && !finished_)
    std::fprintf(out_, "\r\x1b[%dA\x1b[J", drawn_);  // up to the block's first row, clear it
  std::fprintf(out_, "%s\n", text.c_str());
  drawn_ = 0;
  if (mode_ == LaunchViewMode::Live && !finished_) draw();
  std::fflush(out_);
}

std::string LaunchView::node_row(const std::string& name, const PartStatus& st) const {
  std::string row = fmt::format("{:<8}| ", name);
  if (st.step < 0) return row + state_text(st);
  row += fmt::format("{} {} | loss {:.4f}", bar(st.step, st.total_steps),
                     out_of(st.step, st.total_steps), st.loss);
  if (st.val_loss >= 0) row += fmt::format(" | val {:.3f}", st.val_loss);
  row += fmt::format(" | {:.0f} tok/s", st.tokens_per_s);
  if (st.round >= 0) row += " | round " + out_of(st.round, total_rounds_);
  if (st.exited) return row + " | " + state_text(st);
  if (st.eta_s >= 0) row += " | ETA " + format_duration(st.eta_s);
  return row;
}

std::vector<std::string> LaunchView::live_rows() const {
  std::vector<std::string> rows;
  const PartStatus& srv = status_[0];
  std::string s = fmt::format("{:<8}| ", names_[0]);
  if (srv.round >= 0)
    s += fmt::format("round {} published ({} nodes) | ", out_of(srv.round, total_rounds_),
                     srv.round_nodes);
  s += fmt::format("{} joined, {} left", srv.joined, srv.left);
  if (srv.exited || srv.round < 0) s += " | " + state_text(srv);
  rows.push_back(s);
  const size_t nodes = status_.size() - 1;
  const size_t shown = nodes > kLiveNodeRows ? kLiveNodeRows - 1 : nodes;
  for (size_t k = 1; k <= shown; ++k) rows.push_back(node_row(names_[k], status_[k]));
  if (shown < nodes) {
    int64_t lo = INT64_MAX, hi = -1;
    for (size_t k = shown + 1; k <= nodes; ++k) {
      lo = std::min(lo, status_[k].step);
      hi = std::max(hi, status_[k].step);
    }
    rows.push_back(fmt::format("{:<8}| {} more nodes at steps {} to {}", "...", nodes - shown,
                               std::max<int64_t>(lo, 0), std::max<int64_t>(hi, 0)));
  }
  rows.push_back(fmt::format("{:<8}| {}", "all", plain_line()));
  return rows;
}

std::string LaunchView::plain_line() const {
  const auto nodes = stepping_nodes(status_);
  std::string s = fmt::format("[{}] ", format_duration(elapsed_s()));
  if (status_[0].round >= 0) s += fmt::format("round {} | ", out_of(status_[0].round, total_rounds_));
  if (nodes.empty()) {
    int64_t done = 0;
    for (size_t k = 1; k < status_.size(); ++k) done += status_[k].exited ? 1 : 0;
    return s + fmt::format("{} of {} nodes joined, {} exited", status_[0].joined,
                           status_.size() - 1, done);
  }
  int64_t lo = INT64_MAX, hi = -1, total = 0;
  double loss = 0, tps = 0, val = 0;
  int vals = 0;
  double eta = -1;
  for (const PartStatus* st : nodes) {
    lo = std::min(lo, st->step);
    hi = std::max(hi, st->step);
    total = std::max(total, st->total_steps);
    loss += st->loss;
    tps += st->tokens_per_s;  // a node that has finished: its last rate
    if (st->val_loss >= 0) val += st->val_loss, ++vals;
    if (!st->exited) eta = std::max(eta, st->eta_s);  // the slowest node's
  }
  s += "step " + out_of(hi, total);
  if (lo != hi) s += fmt::format(" (nodes {} to {})", lo, hi);
  s += fmt::format(" | loss {:.4f}", loss / static_cast<double>(nodes.size()));
  if (vals > 0) s += fmt::format(" | val {:.3f}", val / vals);
  s += fmt::format(" | {:.0f} tok/s", tps);
  if (eta >= 0) s += " | ETA " + format_duration(eta);
  if (nodes.size() + 1 < status_.size()) s += fmt::format(" | {} nodes stepping", nodes.size());
  return s;
}

void LaunchView::draw() {
  const size_t cols = terminal_columns(out_);
  std::string frame;
  if (drawn_ > 0) frame += fmt::format("\r\x1b[{}A", drawn_);
  const auto rows = live_rows();
  for (const auto& r : rows)
    frame += "\x1b[2K" + (r.size() < cols ? r : r.substr(0, cols - 1)) + "\n";
  frame += "\x1b[J";
  std::fwrite(frame.data(), 1, frame.size(), out_);
  std::fflush(out_);
  drawn_ = static_cast<int>(rows.size());
  last_draw_ = Clock::now();
  dirty_ = false;
}

void LaunchView::tick() {
  if (finished_ || mode_ == LaunchViewMode::All) return;
  const double since = std::chrono::duration<double>(Clock::now() - last_draw_).count();
  if (mode_ == LaunchViewMode::Live) {
    // The elapsed time and the ETA move even without new lines: at least a frame a second.
    if ((dirty_ && since >= kLiveRedrawS) || since >= 1.0) draw();
    return;
  }
  if (since >= plain_every_s_) {
    std::fprintf(out_, "%s\n", plain_line().c_str());
    std::fflush(out_);
    last_draw_ = Clock::now();
  }
}

void LaunchView::finish() {
  if (finished_) return;
  if (mode_ == LaunchViewMode::Live) draw();
  if (mode_ == LaunchViewMode::Plain) std::fprintf(out_, "%s\n", plain_line().c_str());
  std::fflush(out_);
  finished_ = true;
  drawn_ = 0;
}

}  // namespace spes
