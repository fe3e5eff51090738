// safetensors: round trips (F32, BF16, I64, F64, empty, scalar, non-contiguous, metadata), the
// exact byte layout of a tiny file built by hand, and rejection of lying headers with an error
// that says what is wrong.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "spes/common/error.h"
#include "spes/io/safetensors.h"

using namespace spes;
using ::testing::HasSubstr;

namespace {

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file from a header text and raw data bytes.
std::string raw(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

const torch::Tensor& find(const NamedTensors& ts, const std::string& name) {
  for (const auto& [n, t] : ts)
    if (n == name) return t;
  throw std::runtime_error("missing " + name);
}

}  // namespace

TEST(SafetensorsFormat, RoundTripDtypesAndMetadata) {
  torch::manual_seed(1);
  NamedTensors in = {
      {"f32", torch::randn({3, 4})},
      {"bf16", torch::randn({2, 5}).to(torch::kBFloat16)},
      {"i64", torch::tensor(std::vector<int64_t>{-3, 0, int64_t{1} << 40, 7})},
      {"f64", torch::randn({2}, torch::kFloat64)},
      {"empty", torch::zeros({0, 3})},
      {"scalar", torch::tensor(2.5f)},
      {"transposed", torch::arange(6, torch::kFloat32).view({2, 3}).t()},
  };
  Metadata meta = {{"format", "pt"}, {"note", "x=1; \"quoted\""}};
  const std::string bytes = safetensors_serialize(in, meta);
  Metadata got_meta;
  NamedTensors out = safetensors_parse(bytes, &got_meta, "mem");
  EXPECT_EQ(got_meta, meta);
  ASSERT_EQ(out.size(), in.size());
  for (const auto& [name, t] : in) {
    const torch::Tensor& u = find(out, name);
    EXPECT_EQ(u.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(u.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(u, t)) << name;  // bit-exact
  }
  EXPECT_EQ(safetensors_dtype_name(torch::kBFloat16), "BF16");
  EXPECT_EQ(safetensors_dtype_from_name("I64", "x"), torch::kInt64);

  // Through a file.
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("spes_st_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  safetensors_save(path, in, meta);
  Metadata fm;
  NamedTensors fo = safetensors_load(path, &fm);
  EXPECT_EQ(fm, meta);
  EXPECT_TRUE(torch::equal(find(fo, "bf16"), find(in, "bf16")));
  for (const auto& entry : std::filesystem::directory_iterator(
           std::filesystem::temp_directory_path()))
    EXPECT_EQ(entry.path().filename().string().find("spes_st_" + std::to_string(::getpid()) +
                                                    ".safetensors.tmp"),
              std::string::npos);
  std::filesystem::remove(path);
}

// Header length (8 bytes LE), JSON header padded with spaces to an 8-byte boundary, then the
// data in header order: w = [1.0, -2.0] F32, h = [1.0] BF16, i = [5] I64.
TEST(SafetensorsFormat, ByteLayoutOfTinyFile) {
  NamedTensors ts = {{"w", torch::tensor({1.0f, -2.0f})},
                     {"h", torch::tensor({1.0f}).to(torch::kBFloat16)},
                     {"i", torch::tensor({5}, torch::kInt64)}};
  std::string json =
      R"({"__metadata__":{"k":"v"},)"
      R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("h":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]},)"
      R"("i":{"dtype":"I64","shape":[1],"data_offsets":[10,18]}})";
  while ((8 + json.size()) % 8) json += ' ';
  const char data[] = "\x00\x00\x80\x3f"                  // 1.0f
                      "\x00\x00\x00\xc0"                  // -2.0f
                      "\x80\x3f"                          // bf16 1.0
                      "\x05\x00\x00\x00\x00\x00\x00\x00";  // int64 5
  const std::string expected = le64(json.size()) + json + std::string(data, 18);
  const std::string got = safetensors_serialize(ts, {{"k", "v"}});
  EXPECT_EQ(got.size(), expected.size());
  EXPECT_EQ(got, expected);
  EXPECT_EQ(json.size(), 192u);  // 189 JSON bytes + 3 spaces of padding
  EXPECT_EQ(got.substr(0, 8), std::string("\xc0\0\0\0\0\0\0\0", 8));
  // Parsed back in the same order.
  NamedTensors back = safetensors_parse(got);
  ASSERT_EQ(back.size(), 3u);
  EXPECT_EQ(back[0].first, "w");
  EXPECT_EQ(back[1].first, "h");
  EXPECT_EQ(back[2].first, "i");
  // A header without padding and with keys in another order, as other writers produce, reads.
  const std::string other = raw(
      R"({"b":{"data_offsets":[4,8],"shape":[],"dtype":"F32"},"a":{"shape":[1],"dtype":"F32","data_offsets":[0,4]}})",
      std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8));
  NamedTensors o = safetensors_parse(other);
  EXPECT_EQ(find(o, "a").item<float>(), 1.0f);
  EXPECT_EQ(find(o, "b").item<float>(), 2.0f);
  EXPECT_EQ(find(o, "b").dim(), 0);
}

TEST(SafetensorsFormat, LyingHeadersAreRejected) {
  const std::string f8(8, '\0'), f12(12, '\0'), f20(20, '\0');
  auto one = [](const std::string& dtype, const std::string& shape, const std::string& offs) {
    return R"({"a":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" +
           offs + "}}";
  };
  struct Case {
    const char* what;
    std::string bytes;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"truncated (<8 bytes)", std::string("\x10\x00\x00", 3), {"truncated", "at least 8"}},
      {"empty", std::string(), {"truncated"}},
      {"header length past EOF", le64(1000) + "{}", {"header length 1000", "past the end"}},
      {"absurd header length", le64(1ull << 40) + "{}", {"exceeds"}},
      {"non-JSON header", raw("{not json", ""), {"not valid JSON"}},
      {"header not an object", raw("[1,2]", ""), {"JSON object"}},
      {"unknown dtype", raw(one("F8", "[2]", "[0,2]"), std::string(2, '\0')),
       {"unsupported safetensors dtype 'F8'"}},
      {"offsets outside data", raw(one("F32", "[2]", "[0,8]"), std::string(4, '\0')),
       {"'a'", "[0, 8]", "outside the data section"}},
      {"reversed offsets", raw(one("F32", "[2]", "[8,0]"), f8), {"outside the data section"}},
      {"dtype x shape mismatch", raw(one("F32", "[3]", "[0,8]"), f8),
       {"'a'", "occupies 8 bytes", "needs 12"}},
      {"absurd shape", raw(one("F32", "[4294967296,4294967296]", "[0,8]"), f8),
       {"absurd shape"}},
      {"negative dimension", raw(one("F32", "[-2]", "[0,8]"), f8), {"negative"}},
      {"missing field", raw(R"({"a":{"dtype":"F32","shape":[2]}})", f8), {"data_offsets"}},
      {"overlapping tensors",
       raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           f12),
       {"'b'", "overlaps"}},
      {"hole",
       raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
           f20),
       {"hole", "'b'"}},
      {"trailing bytes not covered", raw(one("F32", "[2]", "[0,8]"), f12),
       {"12 bytes", "cover 8"}},
      {"non-string metadata", raw(R"({"__metadata__":{"k":1}})", ""), {"__metadata__"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    std::string msg;
    try {
      Metadata m;
      safetensors_parse(c.bytes, &m, "lying.safetensors");
      msg = "(no error)";
    } catch (const Error& e) {
      msg = e.what();
    } catch (const std::exception& e) {
      msg = std::string("(not spes::Error) ") + e.what();
    }
    EXPECT_THAT(msg, HasSubstr("lying.safetensors"));
    for (const auto& s : c.says) EXPECT_THAT(msg, HasSubstr(s));
  }
  // A truncated file on disk names the path.
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("spes_st_trunc_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  {
    std::ofstream f(path, std::ios::binary);
    f << "abc";
  }
  try {
    safetensors_load(path);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
    EXPECT_THAT(e.what(), HasSubstr("truncated"));
  }
  std::filesystem::remove(path);
  // Every single-byte truncation of a valid file is rejected (never a crash or a bogus tensor).
  const std::string good = safetensors_serialize({{"x", torch::randn({3})}, {"y", torch::randn({2, 2})}});
  for (size_t n = 0; n < good.size(); ++n)
    EXPECT_THROW(safetensors_parse(good.substr(0, n)), Error) << "prefix of " << n << " bytes";
}
