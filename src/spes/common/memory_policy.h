// How this process's heap gives memory back to the kernel. The sync path and training free and
// allocate the same MiB-sized buffers over and over (gRPC slices and message strings per 2 MiB
// chunk, per-round temporaries, activations per step); glibc's default returns such blocks to
// the kernel (mmap and munmap above a threshold that adapts, heap trimming), so each reuse
// faults fresh pages in, which costs about 0.7 s per GiB on a VM whose host reclaims freed
// memory at once (docs/PERFORMANCE.md). keep_freed_heap_memory() has glibc keep blocks up to
// 32 MiB for reuse instead. Memory freed after the peak stays mapped to the process; the peak
// itself did not grow in the measurements (server and training, docs/PERFORMANCE.md).
#pragma once

namespace spes {

// Call once at start, before large allocations. Does nothing when the environment already sets
// glibc's malloc tunables (GLIBC_TUNABLES with glibc.malloc.*: the user's choice wins) or
// without glibc; with another allocator preloaded, glibc's settings change nothing. Returns
// whether it set glibc's policy.
bool keep_freed_heap_memory();

}  // namespace spes
