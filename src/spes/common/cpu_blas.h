// The CPU BLAS that serves fp32 matrix products (ATen's sgemm_): which library it is, which
// OpenBLAS core runs, and the fix for OpenBLAS falling back to generic kernels. OpenBLAS's
// DYNAMIC_ARCH builds pick a core type once, when the library is loaded; a release that does not
// know the CPU model (Debian's 0.3.21 on an Intel Xeon of family 6 model 207) runs its
// "Prescott" SSE3 kernels at a sixth of the AVX-512 rate. select_cpu_blas_core(), called first
// in main(), detects a core whose instruction set is below what the CPU has and re-runs
// OpenBLAS's core selection with the matching type (OPENBLAS_CORETYPE, which its selection
// reads), before any product runs. A user's own OPENBLAS_CORETYPE always wins.
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace spes {

// The vector instruction sets of a CPU that decide which OpenBLAS kernels can run on it.
struct CpuVectorIsa {
  bool avx = false;
  bool avx2_fma = false;     // avx2 and fma (OpenBLAS's Haswell and Zen kernels)
  bool avx512 = false;       // avx512 f, cd, bw, dq and vl (its SkylakeX kernels)
  bool avx512_bf16 = false;  // and avx512_bf16 (its Cooperlake kernels)
};
// From the "flags" line of /proc/cpuinfo (the features the kernel enabled).
CpuVectorIsa cpu_isa_from_flags(std::string_view flags);
CpuVectorIsa this_cpu_isa();  // this machine's (all false when /proc/cpuinfo cannot be read)

// What to do about OpenBLAS's core at process start.
struct OpenBlasCoreChoice {
  std::string switch_to;  // the core type to select; empty: keep the current one
  std::string why;        // one clause for logs: "OpenBLAS chose Prescott, ..."
};
// Pure: the core OpenBLAS chose (openblas_get_corename()), the CPU's instruction sets and the
// user's OPENBLAS_CORETYPE (nullopt when unset). Switches when the chosen core's instruction
// set is below the CPU's (a generic or older core): to Cooperlake on AVX-512 with bf16, SkylakeX
// on AVX-512, Haswell on AVX2 + FMA, Sandybridge on AVX. Never when the user set the type.
OpenBlasCoreChoice choose_openblas_core(const CpuVectorIsa& cpu, const std::string& chosen_core,
                                        const std::optional<std::string>& user_coretype);

// At the start of every process that may run fp32 products on the CPU (spes, the tests, the
// benchmarks), before any of them: when OpenBLAS serves sgemm_ and choose_openblas_core() says
// so, selects the better core in place (OPENBLAS_CORETYPE is set for this process and its
// children, and OpenBLAS's selection re-run). Idempotent; never throws (a failed switch is
// reported by cpu_blas_summary()).
void select_cpu_blas_core();

// Runs OpenBLAS's core selection again as for OPENBLAS_CORETYPE=`core` and returns the core that
// serves afterwards (the same if OpenBLAS does not know the name). For select_cpu_blas_core()
// and its tests: call it only while no BLAS call runs. Throws when OpenBLAS is not the BLAS, or
// its build cannot switch (not DYNAMIC_ARCH).
std::string openblas_switch_core(const std::string& core);

// "OpenBLAS 0.3.21" or "MKL (libtorch's)": the library that ATen's sgemm_ calls reach.
std::string cpu_gemm_library();
// The OpenBLAS core serving now ("SkylakeX"), empty when the BLAS is not OpenBLAS.
std::string openblas_core();
// The library, its core and who chose it, for --version, logs and benchmarks:
// "OpenBLAS 0.3.21, core Cooperlake (OpenBLAS's choice)", "OpenBLAS 0.3.21, core SkylakeX
// (selected by spes: OpenBLAS chose Prescott, a generic core, on a CPU with AVX-512)",
// "OpenBLAS 0.3.21, core Haswell (OPENBLAS_CORETYPE=Haswell)", "MKL (libtorch's)".
std::string cpu_blas_summary();

}  // namespace spes
