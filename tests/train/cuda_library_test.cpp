// libtorch_cuda loaded at run time (train/cuda_library.h): this test binary loads it first
// where an NVIDIA driver is (as `spes` does for the subcommands that may use a GPU); the load
// itself registers libtorch's CUDA kernels and allocator on any machine, GPU or not; the NCCL
// backend comes from its module (libspes_nccl.so). The sync server process never maps the CUDA
// libraries (sync/server_without_cuda_test.cpp).
#include <gtest/gtest.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fstream>
#include <string>

#include "spes/common/build_features.h"
#include "spes/train/cuda_library.h"
#include "spes/train/device.h"
#include "spes/train/dist_backends.h"

namespace {

// Before any test: libtorch decides on first use whether it has CUDA, so the GPU tests
// (cuda_test.cpp) need it loaded before anything calls into torch.
class CudaLibraryEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { spes::load_torch_cuda_if_driver(); }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new CudaLibraryEnvironment);

std::string self_maps() {
  std::ifstream in("/proc/self/maps");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool has_cuda_kernel(const char* op, const char* overload) {
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, overload);
  return handle.hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

TEST(CudaLibrary, LoadsOnDemandAndRegistersTheCudaKernelsAndAllocator) {
  if (!SPES_WITH_CUDA) GTEST_SKIP() << "this libtorch has no CUDA library to load";
  const bool before = spes::torch_cuda_loaded();
  // Without a driver nothing loaded it at the start of this process.
  if (!spes::nvidia_driver_present() && !before) {
    EXPECT_EQ(self_maps().find("libtorch_cuda.so"), std::string::npos);
    EXPECT_FALSE(has_cuda_kernel("aten::add", "Tensor"));
    EXPECT_EQ(spes::torch_cuda_status(), "not loaded: no NVIDIA driver (libcuda.so.1 not found)");
  }
  spes::load_torch_cuda();
  spes::load_torch_cuda();  // idempotent
  EXPECT_TRUE(spes::torch_cuda_loaded());
  EXPECT_EQ(spes::torch_cuda_status(), "loaded");
  // From the folder of the libtorch_cpu this process runs.
  const std::string maps = self_maps();
  const size_t cpu = maps.find("/libtorch_cpu.so"), cuda = maps.find("/libtorch_cuda.so");
  ASSERT_NE(cuda, std::string::npos);
  ASSERT_NE(cpu, std::string::npos);
  auto dir_of = [&](size_t at) {
    const size_t start = maps.rfind(' ', at) + 1;
    return maps.substr(start, at - start);
  };
  EXPECT_EQ(dir_of(cuda), dir_of(cpu));
  // Its static initialisers ran: CUDA kernels in the dispatcher, the caching allocator.
  EXPECT_TRUE(has_cuda_kernel("aten::add", "Tensor"));
  EXPECT_TRUE(has_cuda_kernel("aten::mm", ""));
  EXPECT_NE(c10::GetAllocator(c10::DeviceType::CUDA), nullptr);
}

TEST(CudaLibrary, CudaDevicesNeedADriverAndSayWhy) {
  if (spes::nvidia_driver_present()) GTEST_SKIP() << "this machine has an NVIDIA driver";
  EXPECT_FALSE(spes::cuda_available());
  EXPECT_EQ(spes::cuda_device_count(), 0);
  EXPECT_EQ(spes::device_from_name("auto"), torch::Device(torch::kCPU));
  try {
    spes::device_from_name("cuda:0");
    FAIL() << "cuda:0 accepted without a driver";
  } catch (const spes::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no NVIDIA driver (libcuda.so.1 not found)"),
              std::string::npos) << e.what();
  }
}

TEST(CudaLibrary, TheNcclModuleLoadsAndReportsAMissingGpu) {
  if (!SPES_WITH_CUDA) GTEST_SKIP() << "this libtorch has no CUDA (no NCCL module)";
  if (spes::nvidia_driver_present())
    GTEST_SKIP() << "this machine has an NVIDIA driver: NCCL itself runs in the GPU check "
                    "(DataParallel tests on the GPU machine, scripts/gpu_check.sh)";
  // The module loads (with libtorch_cuda), its entry point runs, and ProcessGroupNCCL's
  // failure to find cuda:0 comes back as one error naming the rank and the device.
  auto store = c10::make_intrusive<c10d::HashStore>();
  try {
    spes::dist_detail::make_nccl_backend(store, 0, 1);
    FAIL() << "an NCCL backend without a GPU";
  } catch (const spes::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 1: NCCL backend on cuda:0 failed: "),
              std::string::npos) << e.what();
  }
  EXPECT_TRUE(spes::torch_cuda_loaded());
  EXPECT_NE(self_maps().find("/libspes_nccl.so"), std::string::npos);
}

}  // namespace
