// Tests of TokenCorpus: prepared directories (uint16/uint32 manifests), raw header-less uint32
// shards, real .npy files, reads across shard boundaries, and the errors for corrupt input.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/data_test_util.h"
#include "spes/common/error.h"
#include "spes/data/token_corpus.h"
#include "spes/io/files.h"

namespace {
using spes::test::le_bytes;
using spes::test::TempDir;
using spes::test::write_bytes;
using json = nlohmann::json;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const spes::Error& e) {
    return e.what();
  }
  return "no error";
}
#define EXPECT_ERROR_HAS(stmt, text) \
  EXPECT_NE(error_of([&] { stmt; }).find(text), std::string::npos) << error_of([&] { stmt; })

// A numpy .npy (format 1.0) holding `data` with dtype `descr` and the given shape text.
std::string npy(const std::string& descr, const std::string& shape, const std::string& data,
                const std::string& order = "False") {
  std::string h = "{'descr': '" + descr + "', 'fortran_order': " + order + ", 'shape': " + shape +
                  ", }";
  while ((10 + h.size() + 1) % 64) h += ' ';
  h += '\n';
  std::string out = "\x93NUMPY\x01";
  out += '\0';
  out += static_cast<char>(h.size() & 0xFF);
  out += static_cast<char>(h.size() >> 8);
  return out + h + data;
}

// A prepared directory with the given shards (as uint16 or uint32) and manifest fields.
void write_manifest_dir(const TempDir& d, const std::string& dtype,
                        const std::vector<std::vector<uint32_t>>& shards, int64_t vocab) {
  json files = json::array();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string bytes;
    if (dtype == "uint16") bytes = le_bytes(std::vector<uint16_t>(shards[s].begin(), shards[s].end()));
    else bytes = le_bytes(shards[s]);
    const std::string name = "tokens-0000" + std::to_string(s) + ".bin";
    write_bytes(d.file(name), bytes);
    files.push_back({{"name", name}, {"tokens", shards[s].size()}, {"sha256", spes::sha256_hex(bytes)}});
  }
  json m = {{"format", "spes-tokens-v1"}, {"dtype", dtype}, {"vocab_size", vocab},
            {"eos_token_id", 0}, {"tokenizer", "tokenizer.json"}, {"files", files}};
  write_bytes(d.file("manifest.json"), m.dump());
}

std::vector<int64_t> read_all(const spes::TokenCorpus& c) {
  std::vector<int64_t> v(c.total_tokens());
  c.read(0, c.total_tokens(), v.data());
  return v;
}

TEST(TokenCorpus, ManifestUint16AcrossShards) {
  TempDir d;
  write_manifest_dir(d, "uint16", {{1, 2, 3}, {4, 5, 65000}, {7}}, 65536);
  spes::TokenCorpus c({d.path.string()});
  EXPECT_EQ(c.total_tokens(), 7);
  EXPECT_EQ(c.shards().size(), 3u);
  EXPECT_EQ(c.shards()[1].start, 3);
  EXPECT_EQ(c.vocab_size(), 65536);
  EXPECT_EQ(c.eos_token_id(), 0);
  EXPECT_EQ(c.max_token_id(), 65000);
  EXPECT_EQ(c.tokenizer_path(), d.file("tokenizer.json"));
  EXPECT_EQ(read_all(c), (std::vector<int64_t>{1, 2, 3, 4, 5, 65000, 7}));
  std::vector<int64_t> mid(3);
  c.read(2, 3, mid.data());  // crosses the first boundary
  EXPECT_EQ(mid, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_THROW(c.read(5, 3, mid.data()), spes::Error);
  c.verify_checksums();
  // Passing manifest.json itself works too.
  EXPECT_EQ(spes::TokenCorpus({d.file("manifest.json")}).total_tokens(), 7);
}

TEST(TokenCorpus, ManifestUint32AndChecksums) {
  TempDir d;
  write_manifest_dir(d, "uint32", {{100000, 2, 3, 4}}, 200000);
  spes::TokenCorpus c({d.path.string()});
  EXPECT_EQ(read_all(c), (std::vector<int64_t>{100000, 2, 3, 4}));
  write_bytes(d.file("tokens-00000.bin"), le_bytes(std::vector<uint32_t>{100000, 2, 3, 5}));
  spes::TokenCorpus changed({d.path.string()});  // same size: only the checksum notices
  EXPECT_ERROR_HAS(changed.verify_checksums(), "is corrupt: sha256");
}

TEST(TokenCorpus, RawUint32AndNpy) {
  TempDir d;
  write_bytes(d.file("ref.npy"), le_bytes(std::vector<uint32_t>{9, 8, 7, 6}));  // no header
  write_bytes(d.file("u2.npy"), npy("<u2", "(3,)", le_bytes(std::vector<uint16_t>{1, 2, 3})));
  write_bytes(d.file("i8.npy"), npy("<i8", "(2,)", le_bytes(std::vector<int64_t>{5, 1LL << 40})));
  write_bytes(d.file("u4.npy"), npy("<u4", "(2, )", le_bytes(std::vector<uint32_t>{11, 12})));
  spes::TokenCorpus c({d.file("ref.npy"), d.file("u2.npy"), d.file("i8.npy"), d.file("u4.npy")});
  EXPECT_EQ(read_all(c), (std::vector<int64_t>{9, 8, 7, 6, 1, 2, 3, 5, 1LL << 40, 11, 12}));
  EXPECT_EQ(c.shards()[0].dtype, "uint32");
  EXPECT_EQ(c.shards()[1].dtype, "uint16");
  EXPECT_EQ(c.shards()[2].dtype, "int64");
  EXPECT_EQ(c.vocab_size(), -1);
  EXPECT_EQ(c.max_token_id(), 1LL << 40);
}

TEST(TokenCorpus, ClearErrors) {
  TempDir d;
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("missing.bin")}), "does not exist");
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.path.string()}), "without manifest.json");
  write_bytes(d.file("empty.bin"), "");
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("empty.bin")}), "is empty");
  write_bytes(d.file("odd.bin"), "abcdef");
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("odd.bin")}), "not a multiple of 4");
  write_bytes(d.file("be.npy"), npy(">u4", "(1,)", "abcd"));
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("be.npy")}), "'>u4' is not supported");
  write_bytes(d.file("f.npy"), npy("<u4", "(1,)", "abcd", "True"));
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("f.npy")}), "Fortran order");
  write_bytes(d.file("2d.npy"), npy("<u2", "(2, 2)", le_bytes(std::vector<uint16_t>{1, 2, 3, 4})));
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("2d.npy")}), "shape (2, 2)");
  write_bytes(d.file("short.npy"), npy("<u2", "(5,)", le_bytes(std::vector<uint16_t>{1, 2})));
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("short.npy")}), "header says 5 ids");
  write_bytes(d.file("neg.npy"), npy("<i4", "(3,)", le_bytes(std::vector<int32_t>{1, -1, 2})));
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("neg.npy")}), "negative id (-1) at index 1");
  write_bytes(d.file("big.bin"), le_bytes(std::vector<uint32_t>{1, 2, 70000}));
  EXPECT_ERROR_HAS(spes::TokenCorpus({d.file("big.bin")}, 65536),
                   "holds id 70000 at index 2, outside the vocabulary of 65536");

  TempDir m;
  write_manifest_dir(m, "uint16", {{1, 2, 3}}, 3);  // id 3 is outside a vocabulary of 3
  EXPECT_ERROR_HAS(spes::TokenCorpus({m.path.string()}), "outside the vocabulary of 3");
  write_manifest_dir(m, "uint16", {{1, 2, 3}}, 100);
  write_bytes(m.file("tokens-00000.bin"), le_bytes(std::vector<uint16_t>{1, 2}));
  EXPECT_ERROR_HAS(spes::TokenCorpus({m.path.string()}), "the manifest says 3 tokens but the file holds 2");
  write_bytes(m.file("manifest.json"), "{\"format\": \"other\"}");
  EXPECT_ERROR_HAS(spes::TokenCorpus({m.path.string()}), "expected 'spes-tokens-v1'");
  write_bytes(m.file("manifest.json"), "{not json");
  EXPECT_ERROR_HAS(spes::TokenCorpus({m.path.string()}), "not valid JSON");
}

}  // namespace
