// The sync server process never maps libtorch_cuda or the CUDA libraries behind it (cuBLAS,
// nvJitLink, ...): `spes serve` does not load them, on a GPU machine either (src/cli/main.cpp,
// train/cuda_library.h), which keeps ~240 MiB out of its memory
// (docs/PERFORMANCE.md, "The sync server without CUDA").
#include <gtest/gtest.h>

#include <string>

#include "sync/serve_fixture.h"

namespace spes::sync::testing {
namespace {

TEST(SyncServerProcess, MapsNoCudaLibrary) {
  ServeFixture f;
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  const std::string maps = read_or_empty("/proc/" + std::to_string(f.srv->p->pid()) + "/maps");
  ASSERT_NE(maps.find("/libtorch_cpu.so"), std::string::npos) << "not a libtorch process?";
  for (const char* lib : {"/libtorch_cuda.so", "/libc10_cuda.so", "/libcublas", "/libnvJitLink",
                          "/libcusparse", "/libnccl"})
    EXPECT_EQ(maps.find(lib), std::string::npos) << "the server maps " << lib;
}

}  // namespace
}  // namespace spes::sync::testing
