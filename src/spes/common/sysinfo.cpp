// Process facts (see sysinfo.h).
#include "spes/common/sysinfo.h"

#include "spes/common/error.h"

#include <limits.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
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

std::string executable_path() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  SPES_CHECK(n > 0, "cannot resolve /proc/self/exe (is /proc mounted?)");
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace spes
