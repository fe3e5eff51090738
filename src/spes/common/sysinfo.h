// Process facts: peak resident memory, CPU time used and the number of CPU cores (for metrics
// and benchmarks), and the path of the running executable (to find files installed next to it,
// or to start it again).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>

namespace spes {

double peak_rss_mb();   // peak RSS of this process image (VmHWM) in MiB
int cpu_cores();        // hardware threads available to this process
// CPU seconds (user + system, every thread) that process `pid` has used so far (0: this one),
// from /proc/PID/stat, in clock ticks (10 ms on Linux); throws when the process is gone.
double process_cpu_seconds(pid_t pid = 0);
std::string executable_path();  // the running executable (/proc/self/exe); throws if unknown

}  // namespace spes
