// End-to-end tests of corpus_prepare: text and JSONL inputs -> shards + manifest + tokenizer,
// read back through TokenCorpus and decoded to the original documents; shard caps, training a
// SentencePiece tokenizer, and the refusal to replace a directory that is not a prepared one.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "data/data_test_util.h"
#include "spes/common/error.h"
#include "spes/data/corpus_prepare.h"
#include "spes/data/token_corpus.h"
#include "spes/data/tokenizer.h"
#include "spes/io/files.h"

namespace {
namespace fs = std::filesystem;
using spes::test::TempDir;
using spes::test::write_bytes;

const std::string kNeox = std::string(SPES_ASSETS_DIR) + "/tokenizers/gpt-neox-olmo-dolma-v1_5.json";

// The documents of a prepared directory, split at EOS and decoded.
std::vector<std::string> decoded_documents(const std::string& dir) {
  spes::TokenCorpus c({dir});
  c.verify_checksums();
  auto tok = spes::tokenizer_load(c.tokenizer_path());
  EXPECT_EQ(c.eos_token_id(), tok->eos_id());
  std::vector<int64_t> ids(c.total_tokens());
  c.read(0, c.total_tokens(), ids.data());
  std::vector<std::string> docs;
  std::vector<int64_t> cur;
  for (int64_t id : ids) {
    if (id == tok->eos_id()) {
      docs.push_back(tok->decode(cur));
      cur.clear();
    } else {
      cur.push_back(id);
    }
  }
  EXPECT_TRUE(cur.empty()) << "the corpus must end with EOS";
  return docs;
}

TEST(CorpusPrepare, TextAndJsonlWithHfTokenizer) {
  TempDir d;
  write_bytes(d.file("a.txt"), "First document,\nsecond line.\n\n\n  \nSecond document.\r\n\r\nThird.");
  write_bytes(d.file("b.jsonl"),
              "{\"body\": \"From JSON \\u00e9\\n with a newline\", \"id\": 1}\n\n"
              "{\"body\": \"  \", \"id\": 2}\n{\"body\": \"Last one\"}\n");
  spes::PrepareOptions o;
  o.inputs = {d.file("a.txt"), d.file("b.jsonl")};
  o.out_dir = d.file("out");
  o.tokenizer = kNeox;
  o.jsonl_field = "body";
  o.shard_tokens = 8;  // forces several shards
  const auto s = spes::corpus_prepare(o);
  EXPECT_EQ(s.documents, 5);  // the blank JSONL text is skipped
  EXPECT_EQ(s.dtype, "uint16");
  EXPECT_EQ(s.vocab_size, 50280);
  EXPECT_EQ(s.tokenizer_file, "tokenizer.json");
  EXPECT_GT(s.files.size(), 1u);
  EXPECT_EQ(decoded_documents(o.out_dir),
            (std::vector<std::string>{"First document,\nsecond line.", "Second document.",
                                      "Third.", "From JSON \u00e9\n with a newline", "Last one"}));
  auto m = nlohmann::json::parse(spes::file_read(o.out_dir + "/manifest.json"));
  EXPECT_EQ(m["format"], "spes-tokens-v1");
  EXPECT_EQ(m["tokens"].get<int64_t>(), s.tokens);
  EXPECT_EQ(m["files"].size(), s.files.size());
  EXPECT_FALSE(fs::exists(o.out_dir + ".tmp-" + std::to_string(::getpid())));

  // Running again replaces the prepared directory; doc-per-file keeps blank lines inside.
  o.doc_per_file = true;
  o.inputs = {d.file("a.txt")};
  o.shard_tokens = 1 << 20;
  EXPECT_EQ(spes::corpus_prepare(o).files.size(), 1u);
  EXPECT_EQ(decoded_documents(o.out_dir),
            (std::vector<std::string>{"First document,\nsecond line.\n\n\n\nSecond document.\n\nThird."}));
}

TEST(CorpusPrepare, TrainsSentencePiece) {
  TempDir d;
  std::string text;
  for (int i = 0; i < 400; ++i)
    text += "Verse " + std::to_string(i) + " of the chapter: the light and the water, day " +
            std::to_string(i % 7) + ".\n" + (i % 10 == 9 ? "\n" : "");
  write_bytes(d.file("c.txt"), text);
  spes::PrepareOptions o;
  o.inputs = {d.file("c.txt")};
  o.out_dir = d.file("sp");
  o.vocab_size = 320;
  const auto s = spes::corpus_prepare(o);
  EXPECT_EQ(s.documents, 40);
  EXPECT_EQ(s.tokenizer_file, "tokenizer.model");
  EXPECT_EQ(s.vocab_size, 320);
  EXPECT_EQ(s.eos_id, 2);
  EXPECT_GT(s.tokenizer_seconds, 0);
  const auto docs = decoded_documents(o.out_dir);
  ASSERT_EQ(docs.size(), 40u);
  EXPECT_EQ(docs[0].substr(0, 37), "Verse 0 of the chapter: the light and");
  EXPECT_EQ(std::count(docs[3].begin(), docs[3].end(), '\n'), 9);
}

TEST(CorpusPrepare, ClearErrors) {
  TempDir d;
  write_bytes(d.file("a.txt"), "text\n");
  spes::PrepareOptions o;
  o.inputs = {d.file("a.txt")};
  o.out_dir = d.file("out");
  EXPECT_THROW(spes::corpus_prepare(o), spes::Error);  // neither tokenizer nor vocab size
  o.tokenizer = kNeox;
  o.vocab_size = 1000;
  EXPECT_THROW(spes::corpus_prepare(o), spes::Error);  // both
  o.vocab_size = 0;
  fs::create_directories(d.file("busy"));
  write_bytes(d.file("busy/keep.txt"), "precious");
  o.out_dir = d.file("busy");
  EXPECT_THROW(spes::corpus_prepare(o), spes::Error);
  EXPECT_TRUE(fs::exists(d.file("busy/keep.txt")));
  write_bytes(d.file("bad.jsonl"), "{\"text\": \"ok\"}\n{\"other\": 1}\n");
  o.out_dir = d.file("out");
  o.inputs = {d.file("bad.jsonl")};
  try {
    spes::corpus_prepare(o);
    ADD_FAILURE() << "expected an error";
  } catch (const spes::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(d.file("out")));
}

}  // namespace
