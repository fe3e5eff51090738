// The progress view of `spes launch` (--progress): on a terminal ("live") one line per node and
// one for the server, redrawn in place (step, loss, validation loss, tokens/s, round, ETA) with
// the launcher's messages and the parts' warnings and errors printed above them; without a
// terminal ("plain": CI, redirection) one line for the whole cluster every --progress-every
// seconds and the same warnings and errors as they come; "all" relays every line of every
// part prefixed "[server]" / "[node i]" (as before). Whatever the view, every line of a part is
// in DIR/<part>/log.txt (the launcher writes them) and a part's warnings and errors are shown.
// Leaves out: colours, terminal resizes redrawing more than the next frame.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "spes/cluster/launch_status.h"

namespace spes {

enum class LaunchViewMode { Auto, Live, Plain, All };
// "auto", "live", "plain" or "all"; anything else is refused naming the choices.
LaunchViewMode launch_view_mode_from_string(const std::string& s);
// Auto: live when `out` is a terminal (and TERM is not "dumb"), else plain.
LaunchViewMode resolve_launch_view_mode(LaunchViewMode mode, std::FILE* out);

class LaunchView {
 public:
  // `parts`: the server's name, then the nodes' ("server", "node 0", ...); `total_rounds`:
  // the rounds of the run (0: unknown).
  LaunchView(LaunchViewMode mode, const std::vector<std::string>& parts, int64_t total_rounds,
             double plain_every_s, std::FILE* out = stdout);
  LaunchViewMode mode() const { return mode_; }

  // A line part k printed (already kept in its log.txt).
  void line(size_t k, const std::string& text);
  void exited(size_t k, int code);
  // The launcher's own line (on a terminal: above the parts' lines).
  void message(const std::string& text);
  // Redraws the live lines, or prints the plain line, when it is due.
  void tick();
  // Draws the final state and stops redrawing: later lines are printed as they come.
  void finish();

  // The texts of the views, for the tests: the live rows and the plain line.
  std::vector<std::string> live_rows() const;
  std::string plain_line() const;

 private:
  void draw();
  void print_above(const std::string& text);
  std::string node_row(const std::string& name, const PartStatus& st) const;
  double elapsed_s() const;

  LaunchViewMode mode_;
  std::vector<std::string> names_;
  std::vector<PartStatus> status_;
  int64_t total_rounds_;
  double plain_every_s_;
  std::FILE* out_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  int drawn_ = 0;      // live: rows of the block on the screen below the cursor's line
  bool dirty_ = true;  // live: the status changed since the last draw
  bool finished_ = false;
};

}  // namespace spes
