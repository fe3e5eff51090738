// `spes score`: prints {"tokens": [...], "logprobs": [...]} for a text (or token ids) under a
// checkpoint or Hugging Face directory, logprobs[i] = log p(tokens[i+1] | tokens[..i]): the
// numbers to compare this implementation with another one. Logs go to stderr.
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <iostream>

#include "cli/command.h"
#include "spes/common/error.h"
#include "spes/data/tokenizer.h"
#include "spes/interop/model_source.h"
#include "spes/interop/score.h"
#include "spes/train/device.h"

namespace {

struct ScoreArgs {
  std::string checkpoint, text, device = "auto";
  std::vector<int64_t> tokens;
};

void run_score(const ScoreArgs& a) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("score"));  // stdout holds only the JSON
  SPES_CHECK(a.text.empty() != a.tokens.empty(), "score: give exactly one of --text and --tokens");
  spes::SourceModel m = spes::source_model_load(a.checkpoint);
  const torch::Device dev = spes::device_from_name(a.device);
  if (!dev.is_cpu()) m.model = spes::transformer_on_device(*m.model, dev);
  std::vector<int64_t> ids = a.tokens;
  if (ids.empty()) {
    SPES_CHECK(!m.tokenizer_file.empty(), "{}: no tokenizer found; pass --tokens instead of --text",
               a.checkpoint);
    ids = spes::tokenizer_load(m.tokenizer_file)->encode(a.text);
  }
  const std::vector<double> lp = spes::score_tokens(*m.model, ids);
  std::cout << nlohmann::ordered_json{{"tokens", ids}, {"logprobs", lp}}.dump() << std::endl;
}

spes::cli::SubcommandRegistrar register_score(
    "score", "Print per-token log-probabilities of a text as JSON", [](CLI::App& sub) {
      auto a = std::make_shared<ScoreArgs>();
      sub.add_option("--checkpoint", a->checkpoint,
                     "Checkpoint or Hugging Face model directory")->required();
      sub.add_option("--text", a->text, "Text to score (tokenized without special tokens)");
      sub.add_option("--tokens", a->tokens, "Token ids to score instead of --text")
          ->delimiter(',');
      sub.add_option("--device", a->device,
                     "auto (a GPU when one is visible), cpu, cuda or cuda:N (fp32 either way)");
      sub.callback([a] { run_score(*a); });
    });

}  // namespace
