// What `spes launch` knows of each of its parts from the lines they print: a node's step,
// loss, validation loss, tokens/s, ETA (its progress lines, `--progress lines`) and the last
// round it applied; the server's last published round and its nodes joined and left; whether
// the part has exited and with which code. Also which lines the launcher must show whatever
// its view (warnings, errors, anything that is not a log line or a progress line), so that a
// child's failure is never hidden. Pure text parsing: the view (launch_view.h) draws it.
#pragma once
#include <cstdint>
#include <string>

namespace spes {

struct PartStatus {
  bool is_server = false;
  // Node: from "step S/T | loss L [| val V] | R tok/s | ETA E".
  int64_t step = -1, total_steps = 0;
  double loss = -1, val_loss = -1, tokens_per_s = 0;
  double eta_s = -1;  // the node's ETA in seconds (printed "2m08s"); -1: unknown
  // Node: the last round it applied; server: the last round it published (and its nodes).
  int64_t round = -1;
  int64_t round_nodes = 0;  // server: nodes in the last published round
  int64_t joined = 0, left = 0;  // server: nodes joined and left so far
  bool exited = false;
  int code = 0;
  std::string last_event;  // a short note for a part without a step yet ("joined at round 0")
};

// Updates `st` from one line the part printed; returns true when the line must be shown to
// the user whatever the view (see should_show_line).
bool update_part_status(PartStatus& st, const std::string& line);

// A warning or error log line ("[warning]", "[error]", "[critical]"), or a line that is
// neither a log line ("[date] [info] ...") nor a progress line ("step S/T | ..."): a crash
// message, "error: ...", "to continue ... run: ...". A "[rank k] " prefix is looked through.
bool should_show_line(const std::string& line);

}  // namespace spes
