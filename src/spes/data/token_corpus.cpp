// Memory-mapped token shards (see token_corpus.h): manifest and .npy header parsing, size
// checks, one scan for the id range, and random access reads across shard boundaries.
#include "spes/data/token_corpus.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <filesystem>

#include "spes/common/error.h"
#include "spes/io/files.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token shards are little-endian; a big-endian host needs byte swapping here"
#endif

namespace spes {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct Mapped {
  const unsigned char* base = nullptr;
  size_t size = 0;
  size_t data_offset = 0;  // header bytes (.npy) before the first id
  int elem = 4;            // bytes per id
  bool is_signed = false;
};

const char* dtype_name(int elem, bool is_signed) {
  static const char* const u[] = {"", "uint8", "uint16", "", "uint32", "", "", "", "uint64"};
  static const char* const s[] = {"", "int8", "int16", "", "int32", "", "", "", "int64"};
  return is_signed ? s[elem] : u[elem];
}

int64_t load_id(const unsigned char* p, int elem, bool is_signed) {
  switch (elem) {
    case 1: return is_signed ? int64_t(int8_t(*p)) : int64_t(*p);
    case 2: { uint16_t v; std::memcpy(&v, p, 2); return is_signed ? int64_t(int16_t(v)) : v; }
    case 4: { uint32_t v; std::memcpy(&v, p, 4); return is_signed ? int64_t(int32_t(v)) : v; }
    default: { int64_t v; std::memcpy(&v, p, 8); return v; }  // uint64 above 2^63: negative
  }
}

// Parses a numpy .npy header; fills data_offset/elem/is_signed and returns the element count.
int64_t parse_npy(const std::string& path, Mapped& m) {
  const unsigned char* b = m.base;
  SPES_CHECK(m.size >= 10, "'{}': truncated .npy header", path);
  const int major = b[6];
  size_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = b[8] | (size_t(b[9]) << 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    SPES_CHECK(m.size >= 12, "'{}': truncated .npy header", path);
    hlen = b[8] | (size_t(b[9]) << 8) | (size_t(b[10]) << 16) | (size_t(b[11]) << 24);
    hstart = 12;
  } else {
    fail("'{}': unsupported .npy format version {} (expected 1, 2 or 3)", path, major);
  }
  SPES_CHECK(hstart + hlen <= m.size, "'{}': .npy header length {} exceeds the file size {}",
             path, hlen, m.size);
  const std::string h(reinterpret_cast<const char*>(b + hstart), hlen);
  auto value_after = [&](const char* key) -> std::string {
    size_t k = h.find(key);
    SPES_CHECK(k != std::string::npos, "'{}': .npy header has no {} (header: {})", path, key, h);
    size_t c = h.find(':', k);
    SPES_CHECK(c != std::string::npos, "'{}': bad .npy header: {}", path, h);
    size_t v = h.find_first_not_of(' ', c + 1);
    return v == std::string::npos ? std::string() : h.substr(v);
  };
  std::string descr = value_after("'descr'");
  SPES_CHECK(descr.size() >= 5 && (descr[0] == '\'' || descr[0] == '"'),
             "'{}': bad descr in .npy header: {}", path, h);
  descr = descr.substr(1, descr.find(descr[0], 1) - 1);
  const char order = descr[0], kind = descr.size() > 1 ? descr[1] : '?';
  const int elem = descr.size() == 3 ? descr[2] - '0' : 0;
  SPES_CHECK((order == '<' || order == '|' || order == '=') && (kind == 'u' || kind == 'i') &&
                 (elem == 1 || elem == 2 || elem == 4 || elem == 8),
             "'{}': .npy dtype '{}' is not supported (expected little-endian integers such as "
             "'<u2', '<u4', '<i4', '<i8')", path, descr);
  SPES_CHECK(value_after("'fortran_order'").rfind("False", 0) == 0,
             "'{}': .npy array is in Fortran order; save it with fortran_order=False", path);
  std::string shape = value_after("'shape'");
  SPES_CHECK(!shape.empty() && shape[0] == '(', "'{}': bad shape in .npy header: {}", path, h);
  shape = shape.substr(1, shape.find(')') - 1);
  std::vector<std::string> dims;
  for (std::string d; ; ) {
    size_t comma = shape.find(',');
    d = shape.substr(0, comma);
    d.erase(std::remove(d.begin(), d.end(), ' '), d.end());
    if (!d.empty()) dims.push_back(d);
    if (comma == std::string::npos) break;
    shape = shape.substr(comma + 1);
  }
  SPES_CHECK(dims.size() == 1, "'{}': .npy array has shape ({}); expected a 1-D array of ids",
             path, fmt::join(dims, ", "));
  const int64_t count = std::stoll(dims[0]);
  m.data_offset = hstart + hlen;
  m.elem = elem;
  m.is_signed = kind == 'i';
  SPES_CHECK(m.size - m.data_offset == size_t(count) * elem,
             "'{}': .npy header says {} ids of {} bytes but {} data bytes follow", path, count,
             elem, m.size - m.data_offset);
  return count;
}

}  // namespace

struct TokenCorpus::Impl {
  std::vector<TokenShard> shards;
  std::vector<Mapped> maps;
  int64_t total = 0;
  int64_t vocab = -1;
  int64_t eos = -1;
  int64_t max_id = -1;
  std::string tokenizer;

  ~Impl() {
    for (auto& m : maps)
      if (m.base) ::munmap(const_cast<unsigned char*>(m.base), m.size);
  }

  // Maps one file; `dtype` is "uint16"/"uint32" for manifest shards, "" to detect (npy or raw).
  void add_file(const std::string& path, const std::string& dtype, int64_t expect_tokens,
                const std::string& sha256) {
    // A relative path is read from the working directory (the default config's
    // data/bible-tokens: the repository's root), so the error names both.
    SPES_CHECK(fs::exists(path), "token shard '{}' does not exist{}; prepare it with `spes "
               "prepare` or set data.paths", path,
               fs::path(path).is_relative()
                   ? fmt::format(" (looked for {}, relative to the working directory {})",
                                 fs::absolute(path).string(), fs::current_path().string())
                   : std::string());
    int fd = ::open(path.c_str(), O_RDONLY);
    SPES_CHECK(fd >= 0, "cannot open token shard '{}': {}", path, std::strerror(errno));
    struct stat st {};
    ::fstat(fd, &st);
    Mapped m;
    m.size = static_cast<size_t>(st.st_size);
    if (m.size == 0) {
      ::close(fd);
      fail("token shard '{}' is empty", path);
    }
    void* p = ::mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);
    SPES_CHECK(p != MAP_FAILED, "cannot map token shard '{}': {}", path, std::strerror(err));
    m.base = static_cast<const unsigned char*>(p);
    maps.push_back(m);  // owned from here on (unmapped by ~Impl even if a check below throws)
    Mapped& mm = maps.back();
    int64_t count;
    if (dtype.empty() && mm.size >= 6 && std::memcmp(mm.base, "\x93NUMPY", 6) == 0) {
      count = parse_npy(path, mm);
    } else {
      mm.elem = dtype == "uint16" ? 2 : 4;
      SPES_CHECK(mm.size % mm.elem == 0,
                 "token shard '{}' has {} bytes, not a multiple of {} ({}{})", path, mm.size,
                 mm.elem, dtype.empty() ? "uint32" : dtype,
                 dtype.empty() ? "; raw shards are flat little-endian uint32 without header" : "");
      count = static_cast<int64_t>(mm.size / mm.elem);
    }
    SPES_CHECK(count > 0, "token shard '{}' holds no tokens", path);
    SPES_CHECK(expect_tokens < 0 || expect_tokens == count,
               "token shard '{}': the manifest says {} tokens but the file holds {} ({} bytes of "
               "{})", path, expect_tokens, count, mm.size, dtype);
    shards.push_back({path, dtype_name(mm.elem, mm.is_signed), count, total, sha256});
    total += count;
  }

  void add_manifest_dir(const std::string& dir) {
    const std::string mpath = (fs::path(dir) / "manifest.json").string();
    SPES_CHECK(fs::exists(mpath), "'{}' is a directory without manifest.json; prepare token "
               "shards with `spes prepare --out {}` or list the shard files", dir, dir);
    json j;
    try {
      j = json::parse(file_read(mpath));
    } catch (const json::exception& e) {
      fail("'{}': not valid JSON: {}", mpath, e.what());
    }
    try {
      const std::string format = j.value("format", std::string());
      SPES_CHECK(format == "spes-tokens-v1", "'{}': format is '{}', expected 'spes-tokens-v1'",
                 mpath, format);
      const std::string dtype = j.at("dtype").get<std::string>();
      SPES_CHECK(dtype == "uint16" || dtype == "uint32",
                 "'{}': dtype '{}' is not supported (expected uint16 or uint32)", mpath, dtype);
      const int64_t v = j.value("vocab_size", int64_t(-1)), e = j.value("eos_token_id", int64_t(-1));
      SPES_CHECK(vocab < 0 || v < 0 || v == vocab, "'{}': vocab_size {} differs from another "
                 "input's {}; all data must come from one tokenizer", mpath, v, vocab);
      if (v > 0) vocab = v;
      if (e >= 0) eos = e;
      if (tokenizer.empty() && j.contains("tokenizer") && j["tokenizer"].is_string())
        tokenizer = (fs::path(dir) / j["tokenizer"].get<std::string>()).string();
      const json& files = j.at("files");
      SPES_CHECK(files.is_array() && !files.empty(), "'{}': 'files' is empty", mpath);
      int64_t sum = 0;
      for (const auto& f : files) {
        const int64_t n = f.at("tokens").get<int64_t>();
        add_file((fs::path(dir) / f.at("name").get<std::string>()).string(), dtype, n,
                 f.value("sha256", std::string()));
        sum += n;
      }
      const int64_t listed = j.value("tokens", sum);
      SPES_CHECK(listed == sum, "'{}': 'tokens' is {} but the files hold {}", mpath, listed, sum);
    } catch (const json::exception& e) {
      fail("'{}': unexpected manifest content: {}", mpath, e.what());
    }
  }

  // One pass over every shard: the id range, checked against the vocabulary when known.
  void scan() {
    for (size_t s = 0; s < maps.size(); ++s) {
      const Mapped& m = maps[s];
      const unsigned char* p = m.base + m.data_offset;
      int64_t lo = INT64_MAX, hi = INT64_MIN;
      auto minmax = [&](auto tag) {
        using T = decltype(tag);
        const int64_t n = shards[s].tokens;
        T mn = std::numeric_limits<T>::max(), mx = std::numeric_limits<T>::min();
        for (int64_t i = 0; i < n; ++i) {
          T v;
          std::memcpy(&v, p + i * sizeof(T), sizeof(T));
          mn = std::min(mn, v);
          mx = std::max(mx, v);
        }
        lo = static_cast<int64_t>(mn);
        hi = static_cast<int64_t>(mx);
      };
      switch (m.elem * (m.is_signed ? -1 : 1)) {
        case 1: minmax(uint8_t()); break;
        case 2: minmax(uint16_t()); break;
        case 4: minmax(uint32_t()); break;
        case 8: minmax(int64_t()); break;  // ids >= 2^63 show up as negative
        case -1: minmax(int8_t()); break;
        case -2: minmax(int16_t()); break;
        case -4: minmax(int32_t()); break;
        default: minmax(int64_t()); break;
      }
      auto first_index = [&](auto pred) {
        for (int64_t i = 0; i < shards[s].tokens; ++i)
          if (pred(load_id(p + i * m.elem, m.elem, m.is_signed))) return i;
        return int64_t(-1);
      };
      if (lo < 0) {
        int64_t i = first_index([](int64_t v) { return v < 0; });
        fail("token shard '{}' holds a negative id ({}) at index {}", shards[s].path,
             load_id(p + i * m.elem, m.elem, m.is_signed), i);
      }
      if (vocab > 0 && hi >= vocab) {
        int64_t i = first_index([&](int64_t v) { return v >= vocab; });
        fail("token shard '{}' holds id {} at index {}, outside the vocabulary of {} ids",
             shards[s].path, load_id(p + i * m.elem, m.elem, m.is_signed), i, vocab);
      }
      max_id = std::max(max_id, hi);
    }
  }
};

TokenCorpus::TokenCorpus(const std::vector<std::string>& paths, int64_t vocab_size)
    : impl_(std::make_unique<Impl>()) {
  SPES_CHECK(!paths.empty(), "no token data given (data.paths is empty)");
  for (const auto& p : paths) {
    if (fs::is_directory(p)) impl_->add_manifest_dir(p);
    else if (fs::path(p).filename() == "manifest.json") impl_->add_manifest_dir(fs::path(p).parent_path().string());
    else impl_->add_file(p, "", -1, "");
  }
  if (vocab_size > 0) impl_->vocab = vocab_size;
  impl_->scan();
}

TokenCorpus::~TokenCorpus() = default;
TokenCorpus::TokenCorpus(TokenCorpus&&) noexcept = default;
TokenCorpus& TokenCorpus::operator=(TokenCorpus&&) noexcept = default;

int64_t TokenCorpus::total_tokens() const { return impl_->total; }
const std::vector<TokenShard>& TokenCorpus::shards() const { return impl_->shards; }
int64_t TokenCorpus::vocab_size() const { return impl_->vocab; }
int64_t TokenCorpus::eos_token_id() const { return impl_->eos; }
int64_t TokenCorpus::max_token_id() const { return impl_->max_id; }
std::string TokenCorpus::tokenizer_path() const { return impl_->tokenizer; }

void TokenCorpus::read(int64_t offset, int64_t n, int64_t* out) const {
  SPES_CHECK(offset >= 0 && n >= 0 && offset + n <= impl_->total,
             "token read [{}, {}) is outside the corpus of {} tokens", offset, offset + n,
             impl_->total);
  const auto& sh = impl_->shards;
  size_t s = std::upper_bound(sh.begin(), sh.end(), offset,
                              [](int64_t o, const TokenShard& t) { return o < t.start; }) -
             sh.begin() - 1;
  while (n > 0) {
    const Mapped& m = impl_->maps[s];
    const int64_t local = offset - sh[s].start, take = std::min(n, sh[s].tokens - local);
    const unsigned char* p = m.base + m.data_offset + local * m.elem;
    if (m.elem == 2 && !m.is_signed) {
      for (int64_t i = 0; i < take; ++i) { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = v; }
    } else if (m.elem == 4 && !m.is_signed) {
      for (int64_t i = 0; i < take; ++i) { uint32_t v; std::memcpy(&v, p + 4 * i, 4); out[i] = v; }
    } else {
      for (int64_t i = 0; i < take; ++i) out[i] = load_id(p + i * m.elem, m.elem, m.is_signed);
    }
    out += take;
    offset += take;
    n -= take;
    ++s;
  }
}

void TokenCorpus::verify_checksums() const {
  for (size_t s = 0; s < impl_->shards.size(); ++s) {
    const TokenShard& sh = impl_->shards[s];
    if (sh.sha256.empty()) continue;
    const Mapped& m = impl_->maps[s];
    const std::string got = sha256_hex(m.base, m.size);
    SPES_CHECK(got == sh.sha256, "token shard '{}' is corrupt: sha256 {} but the manifest says {}",
               sh.path, got, sh.sha256);
  }
}

}  // namespace spes
