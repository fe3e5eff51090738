// `spes import-hf`: turns a Hugging Face model directory (OLMoE, Qwen3-MoE, Llama, Qwen3) into a
// checkpoint to continue training from (fresh optimizer state). See docs/INTEROP.md.
#include <iostream>

#include "cli/command.h"
#include "spes/interop/hf_import.h"

namespace {

struct ImportArgs {
  std::string from, out;
  int64_t max_seq_len = 0;
  bool weights_only = false, overwrite = false;
};

void run_import(const ImportArgs& a) {
  const spes::HfImportResult r =
      spes::hf_import_to_checkpoint(a.from, a.out, a.max_seq_len, a.weights_only, a.overwrite);
  const spes::ModelConfig& m = r.model;
  std::cout << "imported " << r.model_type << " from " << a.from << " to " << a.out << ": "
            << r.num_params << " parameters, " << m.block_type
            << (m.is_moe() ? " (" + std::to_string(m.moe_num_experts) + " experts, top-" +
                                 std::to_string(m.moe_top_k) + ")"
                           : std::string())
            << ", qk_norm " << m.qk_norm << (r.tied_embeddings ? ", lm_head untied" : "")
            << (r.has_tokenizer ? "" : ", no tokenizer") << "\n"
            << "continue training: spes train --config " << a.out
            << "/config.yaml --set data.paths=DATA --resume " << a.out
            << (a.weights_only ? "  (weights only: use --set model.init_checkpoint=" + a.out +
                                     " --resume none instead)"
                               : "")
            << std::endl;
}

spes::cli::SubcommandRegistrar register_import_hf(
    "import-hf", "Turn a Hugging Face model directory into a checkpoint", [](CLI::App& sub) {
      auto a = std::make_shared<ImportArgs>();
      sub.add_option("--from", a->from, "Hugging Face model directory")->required();
      sub.add_option("--out", a->out, "Checkpoint directory to write")->required();
      sub.add_option("--max-seq-len", a->max_seq_len,
                     "model.max_sequence_length (0: max_position_embeddings of config.json)");
      sub.add_flag("--weights-only", a->weights_only,
                   "Omit the fresh optimizer state (then start runs with model.init_checkpoint)");
      sub.add_flag("--overwrite", a->overwrite, "Replace OUT if it exists");
      sub.callback([a] { run_import(*a); });
    }, spes::cli::GpuUse::Never);

}  // namespace
