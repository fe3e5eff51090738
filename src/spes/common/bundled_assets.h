// The data files shipped in the repository's assets/ (a tokenizer.json, the evaluation tasks;
// assets/README.md lists them with their licences), found at run time without ../shared:
// $SPES_ASSETS_DIR if set, then <prefix>/share/spes next to an installed binary, then the
// source tree's assets/ that this build was made from.
#pragma once
#include <string>

namespace spes {

// Absolute path of assets/RELATIVE (e.g. "eval"); throws naming the places it looked.
std::string bundled_asset(const std::string& relative);

}  // namespace spes
