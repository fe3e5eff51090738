// JSON read from files and the network, with its nesting bounded before it is parsed: the JSON
// library parses recursively, so text nested a few hundred thousand levels deep (a hostile
// tokenizer.json or model.safetensors.index.json) overflowed the stack (SIGSEGV) before any
// check could run. json_depth scans the text once (strings skipped); json_parse_bounded
// refuses text deeper than `max_depth` with an error naming the file and the limit, then
// parses it. Every real file the project reads nests a handful of levels.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace spes {

// The deepest nesting of arrays and objects in JSON text, counted until it passes `limit`
// (then some value > limit).
int json_depth(const char* it, const char* end, int limit);

// A depth far above any real file's and far below what overflows a thread's stack.
constexpr int kMaxJsonDepth = 256;

// Parses `text` (from `origin`, named in errors) after checking its depth; throws spes::Error
// ("...nests deeper than N levels...") or the parse error, with the origin.
nlohmann::json json_parse_bounded(std::string_view text, const std::string& origin,
                                  int max_depth = kMaxJsonDepth);

}  // namespace spes
