// Wall-clock helpers for logs and records: seconds elapsed on the steady clock since a time
// point, and the Unix time in seconds. Leaves out: measuring speed (benchmarks in bench/).
#pragma once
#include <chrono>

namespace spes {

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace spes
