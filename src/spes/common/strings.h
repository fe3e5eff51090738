// Small string helpers: splitting, trimming, edit distance and "did you mean" suggestions, and
// making text from outside (a node, a file) safe to log, store and serialise.
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
// `text` as valid, printable UTF-8 of at most about `max_bytes` bytes: invalid UTF-8 and control
// characters become \xNN, and a longer text is cut with "...(N bytes)" appended. For any text
// that came from outside before it is logged, stored in JSON or sent back in an error.
std::string printable(const std::string& text, size_t max_bytes = 200);

}  // namespace spes
