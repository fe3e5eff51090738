// `spes tokenize`: encodes --text with a tokenizer and prints the ids as a JSON array on one
// line, or with --decode turns a JSON array of ids back into text.
#include <nlohmann/json.hpp>

#include <iostream>

#include "cli/command.h"
#include "spes/common/error.h"
#include "spes/data/tokenizer.h"
#include "spes/io/json_depth.h"

namespace {

struct TokenizeArgs {
  std::string tokenizer, text, decode;
};

void run_tokenize(const TokenizeArgs& a) {
  auto tok = spes::tokenizer_load(a.tokenizer);
  if (!a.decode.empty()) {
    nlohmann::json j;
    try {
      j = spes::json_parse_bounded(a.decode, "--decode", 1);
    } catch (const std::exception& e) {
      spes::fail("--decode: expected a JSON array of ids such as [12092,1533]: {}", e.what());
    }
    SPES_CHECK(j.is_array(), "--decode: expected a JSON array of ids, found {}", j.dump());
    std::vector<int64_t> ids;
    for (const auto& v : j) {
      SPES_CHECK(v.is_number_integer(), "--decode: {} is not an integer id", v.dump());
      ids.push_back(v.get<int64_t>());
    }
    std::cout << tok->decode(ids) << std::endl;
    return;
  }
  std::cout << nlohmann::json(tok->encode(a.text)).dump() << std::endl;
}

spes::cli::SubcommandRegistrar register_tokenize("tokenize", "Encode text to token ids (or decode ids)",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<TokenizeArgs>();
  sub.add_option("--tokenizer", a->tokenizer, "tokenizer.json or SentencePiece .model")
      ->required();
  auto* text = sub.add_option("--text", a->text, "Text to encode");
  auto* dec = sub.add_option("--decode", a->decode, "JSON array of ids to decode, e.g. [12092,1533]");
  text->excludes(dec);
  sub.callback([a, text, dec] {
    SPES_CHECK(text->count() + dec->count() == 1, "give --text or --decode");
    run_tokenize(*a);
  });
}, spes::cli::GpuUse::Never);

}  // namespace
