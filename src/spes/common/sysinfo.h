// Process facts: peak resident memory and the number of CPU cores (for metrics), and the path
// of the running executable (to find files installed next to it, or to start it again).
#pragma once
#include <cstdint>
#include <string>

namespace spes {

double peak_rss_mb();   // peak RSS of this process image (VmHWM) in MiB
int cpu_cores();        // hardware threads available to this process
std::string executable_path();  // the running executable (/proc/self/exe); throws if unknown

}  // namespace spes
