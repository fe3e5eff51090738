// Finding and opening the project's shared modules (see shared_module.h).
#include "spes/common/shared_module.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "spes/common/error.h"
#include "spes/common/sysinfo.h"

namespace spes {
namespace {
namespace fs = std::filesystem;

std::vector<std::string> candidate_paths(const SharedModule& m) {
  std::vector<std::string> c;
  if (!m.env_override.empty())
    if (const char* env = std::getenv(m.env_override.c_str()); env && *env) c.push_back(env);
  const fs::path exe = executable_path();
  c.push_back((exe.parent_path() / m.file).string());
  c.push_back((exe.parent_path().parent_path() / m.file).string());
  c.push_back((exe.parent_path().parent_path() / "lib" / m.file).string());
  if (!m.build_path.empty()) c.push_back(m.build_path);
  if (!m.install_path.empty()) c.push_back(m.install_path);
  return c;
}

}  // namespace

void* open_shared_module(const SharedModule& module, int flags) {
  std::string tried;
  for (const std::string& p : candidate_paths(module)) {
    if (!fs::exists(p)) {
      tried += " " + p;
      continue;
    }
    if (void* h = ::dlopen(p.c_str(), flags)) return h;
    const char* why = ::dlerror();
    tried += " " + p + " (" + (why ? why : "dlopen failed") + ")";
  }
  fail("the support library {} was not found or did not load; tried:{} (rebuild spes{})",
       module.file, tried,
       module.env_override.empty() ? "" : ", or set " + module.env_override + " to its path");
}

void* shared_module_symbol(void* handle, const SharedModule& module, const char* name) {
  void* s = ::dlsym(handle, name);
  SPES_CHECK(s, "the support library {} lacks the symbol {} (a stale copy? rebuild spes)",
             module.file, name);
  return s;
}

}  // namespace spes
