// corpus_prepare: text -> token shards, the library side of `spes prepare`. Reads .txt files
// (documents separated by one or more blank lines, or one document per file) and .jsonl/.ndjson
// files (one JSON object per line, text in a configurable field); optionally trains a
// SentencePiece tokenizer on a sample of the lines first; tokenizes with all cores (output order
// is the input order); appends EOS after each document; writes DIR/tokens-NNNNN.bin (uint16 when
// the vocabulary fits, else uint32), the tokenizer file and manifest.json ("spes-tokens-v1").
// The directory is assembled under a temporary name and renamed into place at the end.
// Leaves out: compressed inputs, deduplication, document filtering.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace spes {

struct PrepareOptions {
  std::vector<std::string> inputs;       // .txt / .jsonl / .ndjson files
  std::string out_dir;
  std::string tokenizer;                 // existing tokenizer file; empty: train one
  int64_t vocab_size = 0;                // size of the SentencePiece model to train
  std::string tokenizer_type = "bpe";    // bpe | unigram (when training)
  std::string jsonl_field = "text";
  bool doc_per_file = false;             // each .txt file is one document
  int64_t shard_tokens = int64_t(256) << 20;  // tokens per shard file at most
  int64_t threads = 0;                   // 0: all cores
};

struct PrepareSummary {
  int64_t documents = 0;
  int64_t tokens = 0;  // including one EOS per document
  std::string dtype;
  std::vector<std::string> files;  // shard file names inside out_dir
  int64_t vocab_size = 0;
  int64_t eos_id = 0;
  std::string tokenizer_file;  // name inside out_dir
  double tokenizer_seconds = 0;  // training time (0 when a tokenizer was given)
  double seconds = 0;            // whole run
};

PrepareSummary corpus_prepare(const PrepareOptions& opt);

// Calls `fn(document)` for each document of one input file, in order (empty documents skipped).
// Exposed for tests and tools; throws spes::Error naming file and line on bad JSONL.
void corpus_read_documents(const std::string& path, const PrepareOptions& opt,
                           const std::function<void(std::string&&)>& fn);

}  // namespace spes
