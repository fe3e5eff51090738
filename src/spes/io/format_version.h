// The versions of what spes writes to disk and reads back later, and the one rule for them
// (docs/ARCHITECTURE.md, "Versions"): a file names its format as `<family>-v<N>`
// ("spes-checkpoint-v1"). A change that a reader of the same N can take (a new optional field
// or file, which older readers ignore) keeps N; a change that such a reader would misread bumps
// N. A reader takes every version up to its own newest, filling what an older one lacks with
// the defaults that version implied, and refuses a newer one with both versions and the fix
// (run the newer spes). The sync protocol follows its own, stricter rule (docs/PROTOCOL.md:
// server and nodes must speak the same version).
#pragma once
#include <string>
#include <string_view>

namespace spes {

// The families and the newest version this build writes and reads.
inline constexpr std::string_view kCheckpointFormat = "spes-checkpoint";
inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr std::string_view kServerStateFormat = "spes-server-state";
inline constexpr int kServerStateFormatVersion = 1;

// "<family>-v<version>".
std::string format_name(std::string_view family, int version);
// The version of `format` (a file's "format" value) in `family`; throws spes::Error naming
// `origin` when it is of another family, malformed, or newer than `newest`.
int format_version(const std::string& format, std::string_view family, int newest,
                   const std::string& origin);

}  // namespace spes
