// The heap's policy for returning memory to the kernel (see memory_policy.h).
#include "spes/common/memory_policy.h"

#include <cstdlib>  // first: defines __GLIBC__ on glibc
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace spes {

bool keep_freed_heap_memory() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::strstr(tunables, "glibc.malloc.")) return false;
#if defined(__GLIBC__)
  // Blocks up to glibc's largest threshold (32 MiB on 64-bit) come from the heap, and the heap
  // is not trimmed; larger ones (big tensors) are still mapped and unmapped one by one.
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap_ok && trim_ok;
#else
  return false;
#endif
}

}  // namespace spes
