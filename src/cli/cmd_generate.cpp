// `spes generate`: samples a continuation of a prompt from a checkpoint.
#include <iostream>

#include "cli/command.h"
#include "spes/common/error.h"
#include "spes/eval/generate.h"
#include "spes/train/loaded_model.h"

namespace {

struct GenerateArgs {
  std::string checkpoint, prompt = "And God said";
  spes::SampleOptions sample;
};

void run_generate(const GenerateArgs& a) {
  spes::LoadedModel m = spes::load_model_from_checkpoint(a.checkpoint);
  SPES_CHECK(m.tokenizer, "{}: no tokenizer found in the checkpoint or its config's data",
             a.checkpoint);
  std::vector<int64_t> prompt = m.tokenizer->encode(a.prompt);
  if (prompt.empty()) prompt.push_back(m.tokenizer->eos_id());
  spes::SampleOptions o = a.sample;
  o.stop_token = m.tokenizer->eos_id();
  auto ids = spes::generate_tokens(*m.model, prompt, o);
  std::cout << m.tokenizer->decode(ids) << std::endl;
}

spes::cli::SubcommandRegistrar register_generate("generate", "Sample text from a checkpoint", [](CLI::App& sub) {
  auto a = std::make_shared<GenerateArgs>();
  sub.add_option("--checkpoint", a->checkpoint, "Checkpoint directory")->required();
  sub.add_option("--prompt", a->prompt, "Text to continue");
  sub.add_option("--max-tokens", a->sample.max_new_tokens, "Tokens to generate");
  sub.add_option("--temperature", a->sample.temperature, "Sampling temperature (0: greedy)");
  sub.add_option("--top-k", a->sample.top_k, "Sample among the k most likely tokens (0: all)");
  sub.add_option("--seed", a->sample.seed, "Sampling seed");
  sub.callback([a] { run_generate(*a); });
});

}  // namespace
