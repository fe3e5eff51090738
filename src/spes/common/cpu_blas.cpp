// The CPU BLAS and OpenBLAS's core (see cpu_blas.h).
//
// How the core is switched in place: OpenBLAS's DYNAMIC_ARCH builds keep the selected core's
// kernels and block sizes in one table (`gotoblas`), chosen by gotoblas_dynamic_init() from the
// load-time constructor (OPENBLAS_CORETYPE, else CPUID). Both it and gotoblas_dynamic_quit()
// (which clears the choice) are exported; running quit, then init with the variable set, is what
// a process started with the variable gets, before any product has run. The buffers a product
// uses are sized at build time for every core, so nothing else depends on the choice. This
// costs nothing, where re-executing the process with the variable set would load libtorch twice.
#include "spes/common/cpu_blas.h"

#include <dlfcn.h>
#include <strings.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include "spes/common/error.h"

namespace spes {
namespace {

// Set in the environment (for child processes) with OPENBLAS_CORETYPE when spes selected the
// core: "Prescott->SkylakeX", so that a child reports the selection as spes's, not the user's.
constexpr const char* kSelectedVar = "SPES_OPENBLAS_CORE_SELECTED";

// The instruction-set level of OpenBLAS's core types (case-insensitive names, as
// openblas_get_corename() and OPENBLAS_CORETYPE spell them): 3 AVX-512, 2 AVX2 + FMA, 1 AVX,
// 0 anything older (SSE kernels: Prescott, Core2, Nehalem, Barcelona, ...).
int core_level(const std::string& core) {
  static const char* const kLevels[][2] = {
      {"skylakex", "3"},  {"cooperlake", "3"}, {"sapphirerapids", "3"}, {"haswell", "2"},
      {"zen", "2"},       {"excavator", "2"},  {"sandybridge", "1"},    {"bulldozer", "1"},
      {"piledriver", "1"}, {"steamroller", "1"}};
  for (const auto& [name, level] : kLevels)
    if (::strcasecmp(core.c_str(), name) == 0) return level[0] - '0';
  return 0;
}

int cpu_level(const CpuVectorIsa& cpu) {
  return cpu.avx512 ? 3 : cpu.avx2_fma ? 2 : cpu.avx ? 1 : 0;
}

const char* level_name(int level) {
  static const char* const kNames[] = {"SSE", "AVX", "AVX2", "AVX-512"};
  return kNames[level];
}

// The OpenBLAS that serves sgemm_ (the first sgemm_ in the global scope, which ATen's calls
// reach), or null when another BLAS does.
void* openblas_handle() {
  static void* const handle = [] () -> void* {
    void* sym = ::dlsym(RTLD_DEFAULT, "sgemm_");
    Dl_info info{};
    if (!sym || !::dladdr(sym, &info) || !info.dli_fname) return nullptr;
    if (std::string(info.dli_fname).find("openblas") == std::string::npos) return nullptr;
    return ::dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  }();
  return handle;
}

template <typename Fn>
Fn openblas_symbol(const char* name) {
  void* h = openblas_handle();
  return h ? reinterpret_cast<Fn>(::dlsym(h, name)) : nullptr;
}

// What select_cpu_blas_core() found and did.
struct Selection {
  enum class By { Unknown, OpenBlas, User, Spes } by = By::Unknown;
  std::string detail;  // By::User: the variable's value; By::Spes: the reason
};
std::mutex g_mu;
Selection g_selection;

}  // namespace

CpuVectorIsa cpu_isa_from_flags(std::string_view flags) {
  std::unordered_set<std::string> set;
  std::istringstream in{std::string(flags)};
  for (std::string f; in >> f;) set.insert(f);
  auto has = [&](const char* f) { return set.count(f) > 0; };
  CpuVectorIsa isa;
  isa.avx = has("avx");
  isa.avx2_fma = isa.avx && has("avx2") && has("fma");
  isa.avx512 = isa.avx2_fma && has("avx512f") && has("avx512cd") && has("avx512bw") &&
               has("avx512dq") && has("avx512vl");
  isa.avx512_bf16 = isa.avx512 && has("avx512_bf16");
  return isa;
}

CpuVectorIsa this_cpu_isa() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) return cpu_isa_from_flags(line.substr(line.find(':') + 1));
  return {};
}

OpenBlasCoreChoice choose_openblas_core(const CpuVectorIsa& cpu, const std::string& chosen_core,
                                        const std::optional<std::string>& user_coretype) {
  if (user_coretype) return {"", "OPENBLAS_CORETYPE=" + *user_coretype};
  const int have = core_level(chosen_core), can = cpu_level(cpu);
  if (have >= can) return {"", "OpenBLAS's choice"};
  const char* target = can == 3 ? (cpu.avx512_bf16 ? "Cooperlake" : "SkylakeX")
                       : can == 2 ? "Haswell"
                                  : "Sandybridge";
  const std::string what =
      have == 0 ? "a generic core" : std::string(level_name(have)) + " kernels";
  return {target, fmt::format("OpenBLAS chose {}, {}, on a CPU with {}", chosen_core, what,
                              level_name(can))};
}

std::string openblas_switch_core(const std::string& core) {
  using Fn = void (*)();
  auto quit = openblas_symbol<Fn>("gotoblas_dynamic_quit");
  auto init = openblas_symbol<Fn>("gotoblas_dynamic_init");
  SPES_CHECK(openblas_handle(), "the CPU BLAS is not OpenBLAS: its core cannot be selected");
  SPES_CHECK(quit && init, "this OpenBLAS is not a DYNAMIC_ARCH build: its core ({}) is fixed "
             "at build time", openblas_core());
  std::lock_guard<std::mutex> lk(g_mu);
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::optional<std::string> saved =
      before ? std::optional<std::string>(before) : std::nullopt;
  ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  quit();
  init();  // reads OPENBLAS_CORETYPE; an unknown name falls back to OpenBLAS's own detection
  if (saved) ::setenv("OPENBLAS_CORETYPE", saved->c_str(), 1);
  else ::unsetenv("OPENBLAS_CORETYPE");
  return openblas_core();
}

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::optional<std::string>(v) : std::nullopt;
}

// A core that a spes parent process selected and handed down ("Prescott->SkylakeX" in
// kSelectedVar, OPENBLAS_CORETYPE=SkylakeX): the core OpenBLAS had chosen there, else nullopt.
std::optional<std::string> inherited_selection(const std::optional<std::string>& coretype) {
  const std::optional<std::string> marker = env(kSelectedVar);
  if (!coretype || !marker) return std::nullopt;
  const size_t arrow = marker->find("->");
  if (arrow == std::string::npos || marker->substr(arrow + 2) != *coretype) return std::nullopt;
  return marker->substr(0, arrow);
}

// Switches to `choice.switch_to`; on success hands the choice down to child processes.
Selection apply_choice(const std::string& chosen, const OpenBlasCoreChoice& choice) {
  std::string now = chosen, error;
  try {
    now = openblas_switch_core(choice.switch_to);
  } catch (const Error& e) {
    error = std::string(": ") + e.what();
  }
  if (::strcasecmp(now.c_str(), choice.switch_to.c_str()) != 0)
    return {Selection::By::OpenBlas,
            fmt::format("{}; selecting {} failed{}", choice.why, choice.switch_to, error)};
  ::setenv("OPENBLAS_CORETYPE", choice.switch_to.c_str(), 1);
  ::setenv(kSelectedVar, (chosen + "->" + choice.switch_to).c_str(), 1);
  return {Selection::By::Spes, choice.why};
}

}  // namespace

void select_cpu_blas_core() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!openblas_handle()) return;
    const std::optional<std::string> user = env("OPENBLAS_CORETYPE");
    Selection s;
    if (const auto from = inherited_selection(user)) {
      s = {Selection::By::Spes, "inherited: OpenBLAS chose " + *from};
    } else if (user) {
      s = {Selection::By::User, *user};
    } else {
      const std::string chosen = openblas_core();
      const OpenBlasCoreChoice c = choose_openblas_core(this_cpu_isa(), chosen, std::nullopt);
      s = c.switch_to.empty() ? Selection{Selection::By::OpenBlas, ""} : apply_choice(chosen, c);
    }
    std::lock_guard<std::mutex> lk(g_mu);
    g_selection = s;
  });
}

std::string cpu_gemm_library() {
  void* sym = ::dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (!sym || !::dladdr(sym, &info) || !info.dli_fname) return "unknown";
  const std::string lib = info.dli_fname;
  if (openblas_handle()) {
    using GetConfig = const char* (*)();
    if (auto get = openblas_symbol<GetConfig>("openblas_get_config")) {
      std::string cfg = get();  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ... Zen MAX_THREADS=64"
      const size_t first = cfg.find(' '), second = cfg.find(' ', first + 1);
      return second == std::string::npos ? cfg : cfg.substr(0, second);
    }
    return "OpenBLAS";
  }
  if (lib.find("libtorch_cpu") != std::string::npos) return "MKL (libtorch's)";
  return lib;
}

std::string openblas_core() {
  using GetCore = const char* (*)();
  auto get = openblas_symbol<GetCore>("openblas_get_corename");
  const char* name = get ? get() : nullptr;
  return name ? name : "";
}

std::string cpu_blas_summary() {
  const std::string lib = cpu_gemm_library();
  if (!openblas_handle()) return lib;
  Selection s;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    s = g_selection;
  }
  std::string who;
  switch (s.by) {
    case Selection::By::OpenBlas: who = s.detail.empty() ? "OpenBLAS's choice" : s.detail; break;
    case Selection::By::User: who = "OPENBLAS_CORETYPE=" + s.detail; break;
    case Selection::By::Spes: who = "selected by spes: " + s.detail; break;
    case Selection::By::Unknown: who = "not checked at start"; break;
  }
  return fmt::format("{}, core {} ({})", lib, openblas_core(), who);
}

}  // namespace spes
