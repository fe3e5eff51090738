// `spes prepare`: text files -> token shards + manifest.json (+ tokenizer), ready for
// data.paths. Either uses a given tokenizer file or trains a SentencePiece one of --vocab-size.
// Prints a one-line summary.
#include <fmt/format.h>

#include <iostream>

#include "cli/command.h"
#include "spes/data/corpus_prepare.h"

namespace {

spes::cli::SubcommandRegistrar register_prepare(
    "prepare", "Tokenize text/JSONL files into token shards for training", [](CLI::App& sub) {
      auto o = std::make_shared<spes::PrepareOptions>();
      sub.add_option("--input", o->inputs,
                     "Input files: .txt (documents separated by blank lines) or .jsonl/.ndjson")
          ->required()
          ->expected(1, -1);
      sub.add_option("--out", o->out_dir, "Output directory (created or replaced)")->required();
      auto* tok = sub.add_option("--tokenizer", o->tokenizer,
                                 "Existing tokenizer: tokenizer.json or SentencePiece .model");
      auto* vs = sub.add_option("--vocab-size", o->vocab_size,
                                "Train a SentencePiece tokenizer of this size instead");
      tok->excludes(vs);
      sub.add_option("--tokenizer-type", o->tokenizer_type, "Model type when training")
          ->check(CLI::IsMember({"bpe", "unigram"}));
      sub.add_option("--jsonl-field", o->jsonl_field, "Text field of JSONL records");
      sub.add_flag("--doc-per-file", o->doc_per_file, "Treat each .txt file as one document");
      sub.add_option("--shard-tokens", o->shard_tokens, "Tokens per shard file at most")
          ->check(CLI::PositiveNumber);
      sub.add_option("--threads", o->threads, "Tokenizer threads (0: all cores)");
      sub.callback([o] {
        const spes::PrepareSummary s = spes::corpus_prepare(*o);
        std::cout << fmt::format(
                         "prepared {} documents, {} tokens ({}, vocab {}, eos {}) in {} file(s) "
                         "+ {} at {} in {:.1f} s{}",
                         s.documents, s.tokens, s.dtype, s.vocab_size, s.eos_id, s.files.size(),
                         s.tokenizer_file, o->out_dir, s.seconds,
                         s.tokenizer_seconds > 0
                             ? fmt::format(" (tokenizer training {:.1f} s)", s.tokenizer_seconds)
                             : std::string())
                  << std::endl;
      });
    }, spes::cli::GpuUse::Never);

}  // namespace
