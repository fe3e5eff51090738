// Small string helpers: splitting, trimming, edit distance and "did you mean" suggestions.
#pragma once
#include <string>
#include <vector>

namespace spes {

std::vector<std::string> split(const std::string& s, char sep);
std::string trim(const std::string& s);
bool starts_with(const std::string& s, const std::string& prefix);
bool ends_with(const std::string& s, const std::string& suffix);
size_t edit_distance(const std::string& a, const std::string& b);
// " (did you mean 'x'?)" for the nearest candidate within a small distance, else "".
std::string suggestion_suffix(const std::string& word, const std::vector<std::string>& candidates);
// Human-readable byte count: "1.5 MiB".
std::string human_bytes(double bytes);

}  // namespace spes
