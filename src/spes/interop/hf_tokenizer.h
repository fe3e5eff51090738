// Tokenizer files of a Hugging Face model directory. Export: tokenizer.json (byte-level BPE) is
// copied with a tokenizer_config.json naming PreTrainedTokenizerFast and the eos/pad tokens; a
// SentencePiece tokenizer.model is copied with a tokenizer_config.json for LlamaTokenizer (slow,
// needs the sentencepiece package; no tokenizer.json is made, see the returned notes). Import:
// finds the tokenizer file of a directory.
#pragma once
#include <string>
#include <vector>

#include "spes/io/config.h"

namespace spes {

// Writes the tokenizer files for `tokenizer_file` into `dir`. Returns notes for the user about
// what could not be written.
std::vector<std::string> hf_write_tokenizer(const std::string& dir,
                                            const std::string& tokenizer_file,
                                            const ModelConfig& m);

// dir/tokenizer.json, else dir/tokenizer.model, else "".
std::string find_tokenizer_file(const std::string& dir);

}  // namespace spes
