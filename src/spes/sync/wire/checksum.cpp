// XXH3-128 transport checksums (see checksum.h), from the xxHash header compiled inline.
#include "spes/sync/wire/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstdio>

#include "spes/sync/wire/protocol.h"

namespace spes::sync {

namespace {
std::string hex_of(XXH128_hash_t h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);  // big-endian, as xxh128sum prints it
  static const char* kHex = "0123456789abcdef";
  std::string out(2 * sizeof(c.digest), '0');
  for (size_t i = 0; i < sizeof(c.digest); ++i) {
    out[2 * i] = kHex[c.digest[i] >> 4];
    out[2 * i + 1] = kHex[c.digest[i] & 15];
  }
  return out;
}
}  // namespace

std::string chunk_checksum(std::string_view data) {
  return hex_of(XXH3_128bits(data.data(), data.size()));
}

struct StreamChecksum::State {
  XXH3_state_t s;
};

StreamChecksum::StreamChecksum() : state_(std::make_unique<State>()) {
  XXH3_128bits_reset(&state_->s);
}

StreamChecksum::~StreamChecksum() = default;

void StreamChecksum::update(const void* data, size_t n) {
  XXH3_128bits_update(&state_->s, data, n);
}

std::string StreamChecksum::hex_digest() const { return hex_of(XXH3_128bits_digest(&state_->s)); }

std::string file_checksum(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) sync_fail(SyncErrc::Internal, "cannot open '{}' to check it", path);
  StreamChecksum h;
  std::string buf(4u << 20, '\0');
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) h.update(buf.data(), n);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) sync_fail(SyncErrc::Internal, "cannot read '{}' to check it", path);
  return h.hex_digest();
}

}  // namespace spes::sync
