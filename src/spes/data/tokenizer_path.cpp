// Tokenizer path resolution (see tokenizer_path.h).
#include "spes/data/tokenizer_path.h"

#include <nlohmann/json.hpp>

#include <filesystem>

#include "spes/io/files.h"

namespace spes {
namespace fs = std::filesystem;

std::string resolve_tokenizer_path(const DataConfig& data) {
  if (!data.tokenizer.empty() && fs::exists(data.tokenizer)) return data.tokenizer;
  for (const auto& p : data.paths) {
    const std::string manifest = p + "/manifest.json";
    if (!fs::is_directory(p) || !fs::exists(manifest)) continue;
    try {
      auto j = nlohmann::json::parse(file_read(manifest));
      if (j.contains("tokenizer") && j["tokenizer"].is_string()) {
        const std::string t = p + "/" + j["tokenizer"].get<std::string>();
        if (fs::exists(t)) return t;
      }
    } catch (const nlohmann::json::exception&) {
    }
  }
  return "";
}

}  // namespace spes
