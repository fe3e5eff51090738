// The CPU BLAS's core (common/cpu_blas.h): the decision as a pure function of the CPU's
// instruction sets, OpenBLAS's choice and the user's OPENBLAS_CORETYPE; the in-place switch of
// OpenBLAS's core in this process (products still right, the core reported); and `spes
// --version` naming the BLAS and its core, in a real process, with and without the user's type.
#include <gtest/gtest.h>
#include <gmock/gmock.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "python_reference.h"
#include "spes/common/cpu_blas.h"

using namespace spes;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

namespace {

// Before any test (and any product): as `spes` does first in main().
class CpuBlasEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { select_cpu_blas_core(); }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new CpuBlasEnvironment);

// /proc/cpuinfo flags of the machines in question (abridged to what matters and some noise).
const char* kSapphireRapidsFlags =
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512_bf16 avx512_vnni amx_tile";
const char* kSkylakeFlags = "fpu sse sse2 avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl";
const char* kHaswellFlags = "fpu sse sse2 ssse3 sse4_2 avx f16c fma avx2 bmi1 bmi2";
const char* kOldFlags = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt";

TEST(CpuBlas, ReadsTheVectorInstructionSetsFromCpuinfoFlags) {
  const CpuVectorIsa spr = cpu_isa_from_flags(kSapphireRapidsFlags);
  EXPECT_TRUE(spr.avx && spr.avx2_fma && spr.avx512 && spr.avx512_bf16);
  const CpuVectorIsa skx = cpu_isa_from_flags(kSkylakeFlags);
  EXPECT_TRUE(skx.avx512);
  EXPECT_FALSE(skx.avx512_bf16);
  const CpuVectorIsa hsw = cpu_isa_from_flags(kHaswellFlags);
  EXPECT_TRUE(hsw.avx2_fma);
  EXPECT_FALSE(hsw.avx512);
  // AVX-512 needs all five of f, cd, bw, dq and vl (Knights Landing has f and cd alone).
  EXPECT_FALSE(cpu_isa_from_flags("avx fma avx2 avx512f avx512cd avx512er avx512pf").avx512);
  // Whole words: "avx512f" alone does not make "avx2".
  EXPECT_FALSE(cpu_isa_from_flags("avx avx512f fma").avx2_fma);
  const CpuVectorIsa old = cpu_isa_from_flags(kOldFlags);
  EXPECT_FALSE(old.avx || old.avx2_fma || old.avx512);
}

TEST(CpuBlas, PrescottOnAnAvx512CpuSwitchesToTheAvx512Core) {
  // Debian's OpenBLAS 0.3.21 on an Intel Xeon of family 6 model 207 (issue 33).
  OpenBlasCoreChoice c =
      choose_openblas_core(cpu_isa_from_flags(kSapphireRapidsFlags), "Prescott", std::nullopt);
  EXPECT_EQ(c.switch_to, "Cooperlake");
  EXPECT_EQ(c.why, "OpenBLAS chose Prescott, a generic core, on a CPU with AVX-512");
  c = choose_openblas_core(cpu_isa_from_flags(kSkylakeFlags), "Prescott", std::nullopt);
  EXPECT_EQ(c.switch_to, "SkylakeX");
  // An older vector core on a newer CPU, too.
  c = choose_openblas_core(cpu_isa_from_flags(kHaswellFlags), "Sandybridge", std::nullopt);
  EXPECT_EQ(c.switch_to, "Haswell");
  EXPECT_EQ(c.why, "OpenBLAS chose Sandybridge, AVX kernels, on a CPU with AVX2");
  c = choose_openblas_core(cpu_isa_from_flags(kHaswellFlags), "Nehalem", std::nullopt);
  EXPECT_EQ(c.switch_to, "Haswell");
}

TEST(CpuBlas, KeepsAMatchingCore) {
  for (const char* core : {"Haswell", "Zen", "HASWELL"}) {  // names compare case-insensitively
    OpenBlasCoreChoice c =
        choose_openblas_core(cpu_isa_from_flags(kHaswellFlags), core, std::nullopt);
    EXPECT_EQ(c.switch_to, "") << core;
    EXPECT_EQ(c.why, "OpenBLAS's choice") << core;
  }
  EXPECT_EQ(choose_openblas_core(cpu_isa_from_flags(kSapphireRapidsFlags), "Cooperlake",
                                 std::nullopt).switch_to, "");
  EXPECT_EQ(choose_openblas_core(cpu_isa_from_flags(kSapphireRapidsFlags), "SkylakeX",
                                 std::nullopt).switch_to, "");
  // A core above what the flags say (a virtual machine hiding flags): OpenBLAS knows better.
  EXPECT_EQ(choose_openblas_core(cpu_isa_from_flags(kHaswellFlags), "SkylakeX",
                                 std::nullopt).switch_to, "");
  // Nothing better to run on an SSE-only CPU.
  EXPECT_EQ(choose_openblas_core(cpu_isa_from_flags(kOldFlags), "Prescott", std::nullopt)
                .switch_to, "");
}

TEST(CpuBlas, TheUsersCoreTypeAlwaysWins) {
  const OpenBlasCoreChoice c = choose_openblas_core(cpu_isa_from_flags(kSapphireRapidsFlags),
                                                    "Prescott", std::string("Prescott"));
  EXPECT_EQ(c.switch_to, "");
  EXPECT_EQ(c.why, "OPENBLAS_CORETYPE=Prescott");
}

// The in-place switch on this machine's OpenBLAS: the core reported changes and products stay
// right (against a double-precision reference); switched back at the end.
TEST(CpuBlas, SwitchesOpenBlasCoreInPlace) {
  const std::string start = openblas_core();
  if (start.empty()) GTEST_SKIP() << "the CPU BLAS here is " << cpu_gemm_library();
  struct Restore {
    std::string core;
    ~Restore() { openblas_switch_core(core); }
  } restore{start};
  torch::manual_seed(3);
  const torch::Tensor a = torch::randn({300, 200}), b = torch::randn({200, 250});
  const torch::Tensor want = torch::mm(a.to(torch::kFloat64), b.to(torch::kFloat64));
  for (const char* core : {"Prescott", "Haswell", "Sandybridge"}) {
    EXPECT_EQ(openblas_switch_core(core), core);
    EXPECT_EQ(openblas_core(), core);
    const torch::Tensor got = torch::mm(a, b);
    EXPECT_LT((got.to(torch::kFloat64) - want).abs().max().item<double>(), 1e-3) << core;
  }
  // An unknown name leaves OpenBLAS to its own detection at that moment: a working core, though
  // not always the one it picked when it was loaded (an Intel Xeon, family 6 model 167, with
  // AVX-512 and bf16: SkylakeX when loaded, Cooperlake when detected again).
  const std::string detected = openblas_switch_core("NoSuchCore");
  EXPECT_FALSE(detected.empty());
  EXPECT_LT((torch::mm(a, b).to(torch::kFloat64) - want).abs().max().item<double>(), 1e-3)
      << detected;
  EXPECT_EQ(openblas_switch_core(start), start);
  EXPECT_THAT(cpu_blas_summary(), HasSubstr(", core " + start + " ("));
}

std::string spes_version(const std::string& env) {
  const std::string cmd = env + " " + spes::test::shell_quote(SPES_BINARY) + " --version 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ::pclose(p);
  return out;
}

TEST(CpuBlas, SpesVersionNamesTheBlasAndItsCore) {
  const std::string core = openblas_core();
  if (core.empty()) {
    EXPECT_THAT(spes_version("env -u OPENBLAS_CORETYPE"), HasSubstr("CPU GEMM MKL (libtorch's)"));
    GTEST_SKIP() << "the CPU BLAS here is " << cpu_gemm_library();
  }
  // The same choice this process made at its start (the same machine and library).
  const std::string mine = cpu_blas_summary();
  const std::string v = spes_version("env -u OPENBLAS_CORETYPE -u SPES_OPENBLAS_CORE_SELECTED");
  EXPECT_THAT(v, HasSubstr("CPU GEMM " + mine + ", CUDA")) << v;
  EXPECT_THAT(v, MatchesRegex(".*CPU GEMM OpenBLAS [0-9.]+, core [A-Za-z]+ \\((OpenBLAS's "
                              "choice|selected by spes: OpenBLAS chose [A-Za-z]+, .*)\\).*\n"))
      << v;
  // The user's type wins and is named as theirs.
  EXPECT_THAT(spes_version("env -u SPES_OPENBLAS_CORE_SELECTED OPENBLAS_CORETYPE=Haswell"),
              HasSubstr(", core Haswell (OPENBLAS_CORETYPE=Haswell), CUDA"));
  // A core that spes selected in a parent process is reported as spes's in the child.
  EXPECT_THAT(spes_version(
                  "env OPENBLAS_CORETYPE=Haswell 'SPES_OPENBLAS_CORE_SELECTED=Prescott->Haswell'"),
              HasSubstr(", core Haswell (selected by spes: inherited: OpenBLAS chose Prescott)"));
}

}  // namespace
