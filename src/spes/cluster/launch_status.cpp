// Parts' lines to their status (see launch_status.h).
#include "spes/cluster/launch_status.h"

#include <cstdio>
#include <cstdlib>

#include "spes/common/strings.h"

namespace spes {
namespace {

// The line without a "[rank k] " prefix (the ranks of `--nproc-per-node`); *rank = k, or 0.
std::string without_rank(const std::string& line, int* rank) {
  *rank = 0;
  int k = 0, n = 0;
  if (std::sscanf(line.c_str(), "[rank %d] %n", &k, &n) == 1 && n > 0) {
    *rank = k;
    return line.substr(static_cast<size_t>(n));
  }
  return line;
}

// A log line "[2026-12-05 12:47:18.236] [info] message": its level and message.
bool split_log_line(const std::string& line, std::string* level, std::string* message) {
  if (line.empty() || line[0] != '[') return false;
  const size_t p = line.find("] [");
  if (p == std::string::npos || p > 40) return false;
  const size_t q = line.find(']', p + 3);
  if (q == std::string::npos) return false;
  *level = line.substr(p + 3, q - p - 3);
  *message = q + 2 <= line.size() ? line.substr(q + 2) : "";
  return true;
}

// "1h02m", "3m05s", "42s" (train/metrics.h's format_duration) in seconds; -1 for "?".
double parse_duration(const std::string& text) {
  double total = 0;
  const char* p = text.c_str();
  bool any = false;
  while (*p != 0) {
    char* end = nullptr;
    const double v = std::strtod(p, &end);
    if (end == p) break;
    const char unit = *end;
    total += unit == 'h' ? v * 3600 : unit == 'm' ? v * 60 : v;
    any = true;
    p = unit != 0 ? end + 1 : end;
  }
  return any ? total : -1;
}

// "step S/T | loss L [| val V] | R tok/s | ETA E".
bool parse_progress(PartStatus& st, const std::string& line) {
  long long step = 0, total = 0;
  double loss = 0;
  if (std::sscanf(line.c_str(), "step %lld/%lld | loss %lf", &step, &total, &loss) != 3)
    return false;
  st.step = step;
  st.total_steps = total;
  st.loss = loss;
  if (const size_t v = line.find("| val "); v != std::string::npos)
    st.val_loss = std::strtod(line.c_str() + v + 6, nullptr);
  if (const size_t t = line.find(" tok/s"); t != std::string::npos) {
    const size_t bar = line.rfind("| ", t);
    if (bar != std::string::npos) st.tokens_per_s = std::strtod(line.c_str() + bar + 2, nullptr);
  }
  if (const size_t e = line.find("ETA "); e != std::string::npos) st.eta_s = parse_duration(trim(line.substr(e + 4)));
  return true;
}

// The number after `key` in `text` ("round 3" -> 3), or -1.
int64_t number_after(const std::string& text, const std::string& key) {
  const size_t p = text.find(key);
  if (p == std::string::npos) return -1;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str() + p + key.size(), &end, 10);
  return end == text.c_str() + p + key.size() ? -1 : v;
}

// The server's messages: rounds published, nodes joined and left.
void parse_server_message(PartStatus& st, const std::string& m) {
  if (starts_with(m, "round ") && m.find(") published: ") != std::string::npos) {
    st.round = number_after(m, "round ");
    st.round_nodes = number_after(m, "published: ");
  } else if (starts_with(m, "node ") && m.find(" joined (") != std::string::npos) {
    ++st.joined;
  } else if (starts_with(m, "node ") && m.find(" left at step ") != std::string::npos) {
    ++st.left;
  } else if (starts_with(m, "sync server listening on ")) {
    st.last_event = "listening";
  }
}

// A node's messages: "node 0: joined at round 0 ...", "node 0: round 3 (step 60): ...",
// "node 0: done; ...".
void parse_node_message(PartStatus& st, const std::string& m) {
  const size_t colon = m.find(": ");
  if (!starts_with(m, "node ") || colon == std::string::npos) return;
  const std::string what = m.substr(colon + 2);
  if (starts_with(what, "round ")) {
    st.round = number_after(what, "round ");
  } else if (starts_with(what, "joined at round ")) {
    st.round = number_after(what, "joined at round ");
    st.last_event = "joined";
  } else if (starts_with(what, "joining ")) {
    st.last_event = "joining";
  } else if (starts_with(what, "done")) {
    st.last_event = "done";
  }
}
}  // namespace

bool should_show_line(const std::string& raw) {
  int rank = 0;
  const std::string line = without_rank(raw, &rank);
  std::string level, message;
  if (split_log_line(line, &level, &message))
    return level == "warning" || level == "error" || level == "critical";
  long long a = 0, b = 0;
  if (std::sscanf(line.c_str(), "step %lld/%lld |", &a, &b) == 2) return false;
  return !trim(line).empty();
}

bool update_part_status(PartStatus& st, const std::string& raw) {
  int rank = 0;
  const std::string line = without_rank(raw, &rank);
  std::string level, message;
  if (rank == 0 && !st.is_server) parse_progress(st, line);
  if (rank == 0 && split_log_line(line, &level, &message)) {
    if (st.is_server)
      parse_server_message(st, message);
    else
      parse_node_message(st, message);
  }
  return should_show_line(raw);
}

}  // namespace spes
