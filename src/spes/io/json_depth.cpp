// JSON parsed with its nesting bounded first (see json_depth.h).
#include "spes/io/json_depth.h"

#include <algorithm>

#include "spes/common/error.h"
#include "spes/common/strings.h"

namespace spes {

int json_depth(const char* it, const char* end, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (; it != end && deepest <= limit; ++it) {
    const char c = *it;
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

nlohmann::json json_parse_bounded(std::string_view text, const std::string& origin,
                                  int max_depth) {
  SPES_CHECK(json_depth(text.data(), text.data() + text.size(), max_depth) <= max_depth,
             "{}: the JSON nests deeper than {} levels (arrays and objects), which no real file "
             "does; the file is refused unparsed (is it the file you meant?)", origin, max_depth);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", origin, printable(e.what()));
  }
}

}  // namespace spes
