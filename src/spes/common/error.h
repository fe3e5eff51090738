// Error type used across the library: one exception class whose message is a single line
// naming the problem and, where possible, the fix (file, field, expected vs found).
#pragma once
#include <stdexcept>
#include <string>
#include <fmt/format.h>

namespace spes {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace spes

// Throws spes::Error with a formatted message when `cond` is false.
#define SPES_CHECK(cond, ...)                 \
  do {                                        \
    if (!(cond)) ::spes::fail(__VA_ARGS__);   \
  } while (0)
