// Glue shared by import, upcycling and scoring: a model built from named tensors (names, shapes
// and finiteness checked through the parameter registry), and a fresh checkpoint written from a
// model (step 0, zero AdamW moments for every tensor so that `spes train --resume DIR` accepts
// it on any node layout, or weights only).
#pragma once
#include <memory>
#include <string>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#include "spes/model/transformer.h"

namespace spes {

// Refuses to replace an existing `dir` unless overwrite (names the flag to pass).
void check_output_dir(const std::string& dir, bool overwrite);

// A centralized (single-node) copy of cfg: the registry of such a config holds every tensor.
Config config_single_node(const Config& cfg);

// A CPU model of cfg.model holding exactly `tensors` (every tensor required); no grad.
std::unique_ptr<Transformer> model_from_tensors(const Config& cfg, const NamedTensors& tensors,
                                                const std::string& origin);

// Writes `model` as a checkpoint at `dir` (atomically) with config `cfg` (made single-node,
// model.init_checkpoint cleared), the tokenizer copied from `tokenizer_file` when given, and a
// fresh optimizer state unless weights_only.
void checkpoint_write_fresh(const std::string& dir, const Config& cfg, const Transformer& model,
                            const std::string& tokenizer_file, bool weights_only);

}  // namespace spes
