// File format versions (see format_version.h).
#include "spes/io/format_version.h"

#include <charconv>

#include "spes/common/error.h"
#include "spes/common/strings.h"

namespace spes {

std::string format_name(std::string_view family, int version) {
  return std::string(family) + "-v" + std::to_string(version);
}

int format_version(const std::string& format, std::string_view family, int newest,
                   const std::string& origin) {
  const std::string prefix = std::string(family) + "-v";
  int version = 0;
  const char* digits = format.data() + prefix.size();
  const char* end = format.data() + format.size();
  const bool ours = format.size() > prefix.size() && format.compare(0, prefix.size(), prefix) == 0;
  const auto [stop, ec] = ours ? std::from_chars(digits, end, version)
                               : std::from_chars_result{digits, std::errc::invalid_argument};
  SPES_CHECK(ours && ec == std::errc() && stop == end && version >= 1, "{}: format '{}' is not "
             "{}-v<N>: this is not a file spes wrote for this purpose", origin,
             printable(format, 80), family);
  SPES_CHECK(version <= newest, "{}: written in format {} by a newer spes; this spes reads {} "
             "up to version {}: run the newer spes (or a newer build) on it", origin, format,
             family, newest);
  return version;
}

}  // namespace spes
