// The heap policy (common/memory_policy.h), seen through glibc's own accounting (mallinfo2) in
// fresh child processes: with it, a 20 MiB block comes from the heap and stays there after it
// is freed (the next one reuses it); with glibc's starting policy (the control, the same child
// without the call) the block is mapped on its own and unmapped when freed; and a GLIBC_TUNABLES
// setting of glibc.malloc.* leaves glibc's policy alone.
#include <gtest/gtest.h>

#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "spes/common/memory_policy.h"

namespace {

// What a child saw, as bits of its exit code.
enum : int {
  kPolicyApplied = 1,    // keep_freed_heap_memory() returned true
  kBlockMapped = 2,      // the 20 MiB block was mapped on its own (mallinfo2().hblkhd grew)
  kKeptAfterFree = 4,    // the heap kept the block's memory after free (arena did not shrink)
};

// Runs the probe in a fresh process (glibc's policy is per process and cannot be undone).
int probe(bool apply, const char* tunables) {
  const pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    if (tunables) setenv("GLIBC_TUNABLES", tunables, 1);
    else unsetenv("GLIBC_TUNABLES");
    // glibc's starting policy (128 KiB thresholds), whatever this test process did before the
    // fork: the control.
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    mallopt(M_TRIM_THRESHOLD, 128 << 10);
    int seen = 0;
    if (apply && spes::keep_freed_heap_memory()) seen |= kPolicyApplied;
    const struct mallinfo2 before = mallinfo2();
    const size_t n = 20u << 20;
    char* p = static_cast<char*>(std::malloc(n));
    if (!p) _exit(100);
    std::memset(p, 1, n);
    const struct mallinfo2 held = mallinfo2();
    if (held.hblkhd >= before.hblkhd + n) seen |= kBlockMapped;
    std::free(p);
    const struct mallinfo2 after = mallinfo2();
    if (!(seen & kBlockMapped) && after.arena >= held.arena) seen |= kKeptAfterFree;
    _exit(seen);
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace

TEST(MemoryPolicy, KeepsFreedBlocksOnTheHeapWhereGlibcsDefaultUnmapsThem) {
  const int with = probe(true, nullptr);
  EXPECT_EQ(with, kPolicyApplied | kKeptAfterFree);
  const int control = probe(false, nullptr);  // glibc's starting policy: mapped, then unmapped
  EXPECT_EQ(control, kBlockMapped);
}

TEST(MemoryPolicy, LeavesGlibcAloneWhenTheEnvironmentSetsItsMallocTunables) {
  EXPECT_EQ(probe(true, "glibc.malloc.perturb=0"), kBlockMapped);
  // Other tunables are not the heap's policy: it applies.
  EXPECT_EQ(probe(true, "glibc.rtld.optional_static_tls=512"), kPolicyApplied | kKeptAfterFree);
}
