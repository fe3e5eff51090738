// Settings written as a short text that names a value with some structure of its own: the
// device (`auto`, `cpu`, `cuda`, `cuda:N`) and activation checkpointing (`none`, `whole_layer`,
// `one_in_two`, ..., or OLMo's booleans). Like a Choice (io/choice.h) each is parsed once, when
// the config is read or the value assigned, refused with the allowed forms, and written back in
// its canonical form; code reads its parts (kind and index, blocks between checkpoints), never
// the text. `NamedSetting<T>` tells the config reader and writer that T is such a type.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace spes {

// T has T(std::string), static T::allowed() and name(): read from and written as one string.
template <class T, class = void> struct NamedSetting : std::false_type {};
template <class T>
struct NamedSetting<T, std::void_t<decltype(T(std::string())), decltype(T::allowed()),
                                   decltype(std::declval<const T&>().name())>>
    : std::true_type {};

// `device`: auto (a GPU when libtorch sees one, else the CPU), cpu, cuda (the current GPU) or
// cuda:N.
class DeviceSetting {
 public:
  enum class Kind { Auto, Cpu, Cuda };
  DeviceSetting() = default;
  DeviceSetting(std::string_view text);                                  // NOLINT: throws
  DeviceSetting(const char* text) : DeviceSetting(std::string_view(text)) {}    // NOLINT
  DeviceSetting(const std::string& text) : DeviceSetting(std::string_view(text)) {}  // NOLINT

  Kind kind() const { return kind_; }
  int64_t index() const { return index_; }  // cuda:N -> N; -1 otherwise
  std::string name() const;
  static std::string allowed() { return "auto, cpu, cuda or cuda:N"; }
  friend bool operator==(const DeviceSetting& a, const DeviceSetting& b) {
    return a.kind_ == b.kind_ && a.index_ == b.index_;
  }
  friend bool operator!=(const DeviceSetting& a, const DeviceSetting& b) { return !(a == b); }

 private:
  Kind kind_ = Kind::Auto;
  int64_t index_ = -1;
};

// `activation_checkpointing` (OLMo's key): none (or false) | whole_layer (or true; OLMo's
// fine_grained checkpoints parts of a block, the recomputed unit here is the block) |
// one_in_two | one_in_three | one_in_four.
class ActivationCheckpointing {
 public:
  ActivationCheckpointing() = default;
  ActivationCheckpointing(std::string_view text);  // NOLINT: throws
  ActivationCheckpointing(const char* text)        // NOLINT
      : ActivationCheckpointing(std::string_view(text)) {}
  ActivationCheckpointing(const std::string& text)  // NOLINT
      : ActivationCheckpointing(std::string_view(text)) {}

  // Blocks between checkpointed ones: 0 none, 1 every block, n one in n.
  int64_t every() const { return every_; }
  std::string name() const;
  static std::string allowed() {
    return "none, whole_layer, one_in_two, one_in_three, one_in_four or fine_grained (or false "
           "/ true)";
  }
  friend bool operator==(ActivationCheckpointing a, ActivationCheckpointing b) {
    return a.every_ == b.every_;
  }

 private:
  int64_t every_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const DeviceSetting& s) {
  return os << s.name();
}
inline std::ostream& operator<<(std::ostream& os, ActivationCheckpointing s) {
  return os << s.name();
}

}  // namespace spes

template <> struct fmt::formatter<spes::DeviceSetting> : fmt::formatter<std::string_view> {
  template <class Ctx> auto format(const spes::DeviceSetting& s, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(s.name(), ctx);
  }
};
template <>
struct fmt::formatter<spes::ActivationCheckpointing> : fmt::formatter<std::string_view> {
  template <class Ctx> auto format(const spes::ActivationCheckpointing& s, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(s.name(), ctx);
  }
};
