// Parsing and canonical names of the structured settings (see named_settings.h).
#include "spes/io/named_settings.h"

#include <array>
#include <charconv>

#include "spes/common/error.h"

namespace spes {

DeviceSetting::DeviceSetting(std::string_view text) {
  if (text == "auto") return;
  if (text == "cpu") {
    kind_ = Kind::Cpu;
    return;
  }
  if (text == "cuda") {
    kind_ = Kind::Cuda;
    return;
  }
  constexpr std::string_view kCudaColon = "cuda:";
  if (text.substr(0, kCudaColon.size()) == kCudaColon) {
    const std::string_view digits = text.substr(kCudaColon.size());
    int64_t n = -1;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
    if (ec == std::errc() && end == digits.data() + digits.size() && !digits.empty() &&
        n >= 0 && n < 1024) {
      kind_ = Kind::Cuda;
      index_ = n;
      return;
    }
  }
  fail("must be {}, found '{}'", allowed(), std::string(text.substr(0, 200)));
}

std::string DeviceSetting::name() const {
  switch (kind_) {
    case Kind::Auto: return "auto";
    case Kind::Cpu: return "cpu";
    case Kind::Cuda: return index_ >= 0 ? "cuda:" + std::to_string(index_) : "cuda";
  }
  return "auto";
}

namespace {
// The canonical names by blocks between checkpoints, then the accepted other spellings.
constexpr std::array<std::pair<std::string_view, int64_t>, 8> kCheckpointingNames{
    {{"none", 0}, {"whole_layer", 1}, {"one_in_two", 2}, {"one_in_three", 3},
     {"one_in_four", 4}, {"false", 0}, {"true", 1}, {"fine_grained", 1}}};
}  // namespace

ActivationCheckpointing::ActivationCheckpointing(std::string_view text) {
  if (text.empty()) return;  // OLMo's null
  for (const auto& [name, every] : kCheckpointingNames)
    if (name == text) {
      every_ = every;
      return;
    }
  fail("must be {}, found '{}'", allowed(), std::string(text.substr(0, 200)));
}

std::string ActivationCheckpointing::name() const {
  for (const auto& [name, every] : kCheckpointingNames)
    if (every == every_) return std::string(name);
  return "none";
}

}  // namespace spes
