// Process facts (see sysinfo.h).
#include "spes/common/sysinfo.h"

#include "spes/common/error.h"

#include <limits.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

namespace spes {

double peak_rss_mb() {
  // VmHWM of this process image. Not getrusage's ru_maxrss: Linux carries that over an
  // execve, so a process started by a large parent (e.g. `spes serve` spawned by the sync
  // benchmark holding N models) would report the parent's peak instead of its own.
  if (std::FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long kib = -1;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
    std::fclose(f);
    if (kib >= 0) return static_cast<double>(kib) / 1024.0;
  }
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

int cpu_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

double process_cpu_seconds(pid_t pid) {
  const std::string path = pid == 0 ? "/proc/self/stat" : fmt::format("/proc/{}/stat", pid);
  std::ifstream f(path);
  std::string line;
  SPES_CHECK(f && std::getline(f, line), "cannot read '{}' (has the process exited?)", path);
  // "PID (COMM) STATE ..." where COMM may hold spaces and parentheses: fields count from the
  // last ')'; utime and stime are fields 14 and 15 of the line, the 12th and 13th after STATE.
  const size_t close = line.rfind(')');
  SPES_CHECK(close != std::string::npos, "'{}' is not a process stat line: {}", path, line);
  std::istringstream in(line.substr(close + 1));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 13 && (in >> field); ++i) {}
  SPES_CHECK(static_cast<bool>(in >> utime >> stime), "'{}': no CPU times in {}", path, line);
  static const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  return static_cast<double>(utime + stime) / ticks;
}

std::string executable_path() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  SPES_CHECK(n > 0, "cannot resolve /proc/self/exe (is /proc mounted?)");
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace spes
