// Locating the files of assets/ at run time (see bundled_assets.h).
#include "spes/common/bundled_assets.h"

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "spes/common/error.h"
#include "spes/common/sysinfo.h"

namespace spes {
namespace fs = std::filesystem;

std::string bundled_asset(const std::string& relative) {
  std::vector<fs::path> roots;
  if (const char* env = std::getenv("SPES_ASSETS_DIR"); env && *env) roots.emplace_back(env);
  roots.push_back(fs::path(executable_path()).parent_path().parent_path() / "share" / "spes");
  roots.emplace_back(SPES_SOURCE_ASSETS_DIR);
  std::string tried;
  for (const auto& root : roots) {
    const fs::path p = root / relative;
    if (fs::exists(p)) return fs::absolute(p).lexically_normal().string();
    tried += (tried.empty() ? "" : ", ") + p.string();
  }
  throw Error(fmt::format("bundled file '{}' not found (looked in {}); set SPES_ASSETS_DIR to "
                          "the assets/ directory of a spes checkout or installation",
                          relative, tried));
}

}  // namespace spes
