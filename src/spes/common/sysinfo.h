// Process facts used in metrics: peak resident memory and the number of CPU cores.
#pragma once
#include <cstdint>

namespace spes {

double peak_rss_mb();   // peak RSS of this process image (VmHWM) in MiB
int cpu_cores();        // hardware threads available to this process

}  // namespace spes
