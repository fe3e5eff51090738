// The keys of the reference's (OLMo/SPES) training YAML that are not plain fields of this
// project's config. Before config.cpp reads the fields, reference_keys_resolve() rewrites the
// YAML tree so that every key of OLMo's TrainConfig (and its model, optimizer, scheduler, data,
// spes_config sections) ends up in exactly one of three classes:
//  - mapped, with OLMo's meaning: a field of this project under the same name (model.d_model,
//    model.mlp_hidden_size, ...: listed by the structs' visit()), or translated here onto this
//    project's keys (using_spes / using_dilico -> spes_config.mode, attention_layer_norm(_over_
//    head) -> model.qk_norm, moe_normalize_expert_weights -> model.moe_norm_topk_prob, ...), or
//    accepted where it holds the one value this project implements (weight_tying: false,
//    include_bias: false, rope: true, ...);
//  - operational (fsdp, wandb, save folders, stop_at, ...): no effect on the model or the
//    method here; removed and returned, for the one warning line that names them all;
//  - refused: a value that would change the model or the method and is not implemented, with
//    the key, the value and what this project does instead named in the error.
// Keys absent from a file take this project's defaults (those of OLMo where the model shape
// depends on them: mlp_hidden_size unset, mlp_ratio 4). The table is in docs/INTEROP.md.
#pragma once
#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

namespace spes {

// Rewrites `root` (the whole config, --set overrides applied) in place; returns the operational
// keys it removed, in file order. Throws spes::Error naming `origin` and the key on a refusal.
std::vector<std::string> reference_keys_resolve(YAML::Node& root, const std::string& origin);

// Every dotted key handled here (for "did you mean" suggestions).
std::vector<std::string> reference_key_names();

}  // namespace spes
