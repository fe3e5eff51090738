// `spes export-hf`: writes a checkpoint as a Hugging Face directory (config.json, safetensors,
// tokenizer files) that transformers loads without custom code. See docs/INTEROP.md.
#include <spdlog/spdlog.h>

#include <iostream>

#include "cli/command.h"
#include "spes/interop/hf_export.h"
#include "spes/interop/hf_weights.h"

namespace {

struct ExportArgs {
  std::string checkpoint, out, dtype = "float32", max_shard_size = "5GB";
  bool overwrite = false;
};

void run_export(const ExportArgs& a) {
  spes::HfExportOptions o;
  o.dtype = spes::hf_dtype_from_name(a.dtype);
  o.max_shard_bytes = spes::parse_byte_size(a.max_shard_size, "--max-shard-size");
  o.overwrite = a.overwrite;
  const spes::HfExportResult r = spes::hf_export(a.checkpoint, a.out, o);
  for (const auto& n : r.notes) spdlog::warn("{}", n);
  std::cout << "exported " << a.checkpoint << " as " << r.architecture.architecture
            << " (model_type " << r.architecture.model_type << ", " << a.dtype << ", "
            << r.weight_bytes << " bytes of weights) to " << a.out << ":";
  for (const auto& f : r.files) std::cout << " " << f;
  std::cout << std::endl;
}

spes::cli::SubcommandRegistrar register_export_hf(
    "export-hf", "Write a checkpoint as a Hugging Face model directory", [](CLI::App& sub) {
      auto a = std::make_shared<ExportArgs>();
      sub.add_option("--checkpoint", a->checkpoint, "Checkpoint directory")->required();
      sub.add_option("--out", a->out, "Output directory (written atomically)")->required();
      sub.add_option("--dtype", a->dtype, "Weight dtype: float32, bfloat16 or float16");
      sub.add_option("--max-shard-size", a->max_shard_size,
                     "Largest safetensors file before sharding (e.g. 5GB, 500MB, 2GiB)");
      sub.add_flag("--overwrite", a->overwrite, "Replace OUT if it exists");
      sub.callback([a] { run_export(*a); });
    }, spes::cli::GpuUse::Never);

}  // namespace
