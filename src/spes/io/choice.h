// A setting that takes one of a fixed set of names (spes_config.mode, transfer_dtype, ...):
// the name is parsed once, when the config is read or the value assigned, and refused with
// the allowed names; afterwards code compares enum values, never the setting's text. The name
// round-trips through YAML, JSON and logs (name(), operator<<, fmt). Each enum lists its names
// once, in a ChoiceNames specialisation next to the enum (io/config.h).
#pragma once
#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include "spes/common/error.h"

namespace spes {

// Specialise with `static constexpr std::array<std::pair<E, std::string_view>, N> names`.
template <class E> struct ChoiceNames;

template <class E> class Choice {
 public:
  using Enum = E;
  constexpr Choice(E v) : v_(v) {}  // NOLINT: implicit on purpose (cfg.mode = SyncMode::Spes)
  Choice(std::string_view name) : v_(parse(name)) {}  // NOLINT: throws spes::Error if unknown
  Choice(const char* name) : Choice(std::string_view(name)) {}        // NOLINT
  Choice(const std::string& name) : Choice(std::string_view(name)) {}  // NOLINT

  constexpr operator E() const { return v_; }  // NOLINT: for switch and comparisons
  constexpr E value() const { return v_; }
  std::string name() const { return std::string(name_of(v_)); }

  // The enum value called `s`; throws "must be a, b or c, found 's'" otherwise.
  static E parse(std::string_view s) {
    for (const auto& [v, n] : ChoiceNames<E>::names)
      if (n == s) return v;
    fail("must be {}, found '{}'", allowed(), std::string(s));
  }
  // "a, b or c".
  static std::string allowed() {
    std::string out;
    const auto& names = ChoiceNames<E>::names;
    for (size_t i = 0; i < names.size(); ++i) {
      if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
      out += names[i].second;
    }
    return out;
  }
  static std::string_view name_of(E v) {
    for (const auto& [e, n] : ChoiceNames<E>::names)
      if (e == v) return n;
    return "?";
  }

  friend bool operator==(Choice a, Choice b) { return a.v_ == b.v_; }
  friend bool operator!=(Choice a, Choice b) { return a.v_ != b.v_; }
  friend bool operator==(Choice a, E b) { return a.v_ == b; }
  friend bool operator!=(Choice a, E b) { return a.v_ != b; }
  friend bool operator==(E a, Choice b) { return a == b.v_; }
  friend bool operator!=(E a, Choice b) { return a != b.v_; }
  // Against a name (tests, reference configs); an unknown name throws like parse().
  friend bool operator==(Choice a, const char* b) { return a.v_ == parse(b); }
  friend bool operator!=(Choice a, const char* b) { return a.v_ != parse(b); }
  friend bool operator==(Choice a, const std::string& b) { return a.v_ == parse(b); }
  friend bool operator!=(Choice a, const std::string& b) { return a.v_ != parse(b); }
  friend std::ostream& operator<<(std::ostream& os, Choice c) { return os << name_of(c.v_); }

 private:
  E v_;
};

}  // namespace spes

template <class E> struct fmt::formatter<spes::Choice<E>> : fmt::formatter<std::string_view> {
  template <class Ctx> auto format(const spes::Choice<E>& c, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(spes::Choice<E>::name_of(c.value()), ctx);
  }
};
