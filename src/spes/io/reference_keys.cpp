// The reference's (OLMo/SPES) YAML keys that are not plain config fields (see reference_keys.h).
// Three tables (operational keys, keys accepted at one value, null meaning "unset") and the
// translations that need code (mode, QK-norm, normalised top-k, z-loss, warm-up start, data seed).
#include "spes/io/reference_keys.h"

#include <cmath>
#include <set>

#include "spes/common/error.h"
#include "spes/io/config.h"

namespace spes {
namespace {

// Keys with no effect on the model or the method here (parallelism, logging, checkpoint files,
// evaluation harness, stopping early, data-loader workers). Sections are ignored as a whole.
const char* const kOperational[] = {
    // top level
    "dry_run", "epoch", "no_pre_train_checkpoint", "wandb", "compile", "fused_loss",
    "restore_dataloader", "fast_forward_batches", "evaluators", "tokenizer", "save_folder",
    "remote_save_folder", "canceled_check_interval", "save_interval_unsharded",
    "save_interval_ephemeral", "save_num_unsharded_checkpoints_to_keep", "save_overwrite",
    "force_save_unsharded", "try_load_latest_save", "reset_optimizer_state",
    "reset_trainer_state", "sharded_checkpointer", "new_style_checkpoints",
    "load_path_sharded_checkpointer", "stop_at", "stop_after", "device_train_batch_size",
    "device_eval_batch_size", "eval_subset_num_batches", "eval_on_load",
    "device_train_grad_accum", "speed_monitor", "console_log_interval", "gen1_gc_interval",
    "distributed_strategy", "fsdp", "ddp", "single", "time_limit", "extra_steps_after_cancel",
    "early_stopping_factor", "save_data_indices", "python_profiling", "torch_profiling",
    "hf_datasets_cache_dir", "module_outputs_save_steps",
    // Declared by the reference but never read by its trainer (its output z-loss weight is the
    // loss function's default 1e-4, model.z_loss_weight here).
    "auxiliary_loss_multiplier",
    // model: kernels, devices, logging, and keys that only act with a value refused below
    "model.block_group_size", "model.flash_attention", "model.init_device", "model.precision",
    "model.using_custom_moe_impl", "model.moe_mlp_impl", "model.moe_log_expert_assignment",
    "model.moe_lbl_in_fp32", "model.rope_full_precision", "model.moe_capacity_factor",
    "model.alibi_bias_max", "model.scale_emb_init",
    "optimizer.metrics_log_interval", "optimizer.record_update_metrics",
    // data loading; instance_filter drops windows with long repeated n-grams in the reference
    "data.pad_direction", "data.num_workers", "data.drop_last", "data.pin_memory",
    "data.prefetch_factor", "data.persistent_workers", "data.timeout", "data.instance_filter",
    "spes_config.decayed_factor_update_steps", "spes_config.enable"};

bool is_null(const YAML::Node& v) { return v.IsNull(); }
bool scalar_is(const YAML::Node& v, const char* s) { return v.IsScalar() && v.Scalar() == s; }
bool as_bool(const YAML::Node& v, bool want) {
  try {
    return v.IsScalar() && v.as<bool>() == want;
  } catch (const YAML::Exception&) {
    return false;
  }
}
bool is_true(const YAML::Node& v) { return as_bool(v, true); }
bool is_false(const YAML::Node& v) { return as_bool(v, false); }
bool is_false_or_null(const YAML::Node& v) { return is_null(v) || is_false(v); }
bool is_zero(const YAML::Node& v) {
  try {
    return v.IsScalar() && v.as<double>() == 0.0;
  } catch (const YAML::Exception&) {
    return false;
  }
}

// Keys accepted only at the value this project implements (then they are mapped: the file says
// what the model does anyway); any other value is refused with `does`.
struct OneValue {
  const char* key;
  const char* value;  // the accepted value, as the error writes it
  bool (*ok)(const YAML::Node&);
  const char* does;   // what this project does instead
};
const OneValue kOneValue[] = {
    {"model.weight_tying", "false", is_false,
     "the LM head is its own [vocab, d_model] matrix here (untied, as in OLMoE); tied "
     "embeddings are not implemented"},
    {"model.include_bias", "false", is_false, "spes models have no biases"},
    {"model.bias_for_layer_norm", "false or null", is_false_or_null, "spes norms have no bias"},
    {"model.alibi", "false", is_false, "spes encodes positions with RoPE (no ALiBi)"},
    {"model.rope", "true", is_true,
     "spes encodes positions with RoPE (no learned position embeddings)"},
    {"model.activation_type", "swiglu", [](const YAML::Node& v) { return scalar_is(v, "swiglu"); },
     "spes experts and MLPs are SwiGLU"},
    {"model.layer_norm_type", "rms", [](const YAML::Node& v) { return scalar_is(v, "rms"); },
     "spes norms are RMSNorm in fp32 with a learnable weight"},
    {"model.layer_norm_with_affine", "true", is_true, "spes RMSNorms have a learnable weight"},
    {"model.attention_layer_norm_with_affine", "true", is_true,
     "spes QK-norms have a learnable weight"},
    {"model.attention_dropout", "0", is_zero, "spes has no dropout"},
    {"model.residual_dropout", "0", is_zero, "spes has no dropout"},
    {"model.embedding_dropout", "0", is_zero, "spes has no dropout"},
    {"model.embedding_layer_norm", "false", is_false, "spes has no norm on the embeddings"},
    {"model.scale_logits", "false", is_false, "spes does not scale the logits"},
    {"model.clip_qkv", "null", is_null, "spes does not clip q/k/v"},
    {"model.multi_query_attention", "false or null", is_false_or_null,
     "set model.n_kv_heads: 1 for multi-query attention"},
    {"model.moe_dropless", "true", is_true, "spes MoE layers are dropless (no capacity limit)"},
    {"model.moe_shared_expert", "false", is_false, "spes MoE layers have no shared expert"},
    {"model.norm_after", "false", is_false, "spes blocks are pre-norm"},
    {"model.init_fn", "normal", [](const YAML::Node& v) { return scalar_is(v, "normal"); },
     "spes draws every matrix from one truncated normal (model.init_std, init_cutoff_factor)"},
    {"model.emb_init_std", "null", is_null, "spes initialises the embeddings with model.init_std"},
    {"optimizer.decay_norm_and_bias", "true", is_true,
     "spes AdamW applies weight decay to every trainable tensor, norms included"},
    {"optimizer.decay_embeddings", "true", is_true,
     "spes AdamW applies weight decay to every trainable tensor, embeddings included"},
    {"optimizer.no_decay_norm_and_bias", "false or null", is_false_or_null,
     "spes AdamW applies weight decay to every trainable tensor, norms included"},
    {"optimizer.selective_updates", "false", is_false,
     "spes AdamW updates every trainable tensor at every step"},
    {"scheduler.units", "steps", [](const YAML::Node& v) { return scalar_is(v, "steps"); },
     "spes schedules count optimizer steps (t_warmup, t_max)"},
    {"scheduler.grad_clip_warmup_steps", "null", is_null,
     "spes clips at max_grad_norm from the first step"},
    {"scheduler.grad_clip_warmup_factor", "null", is_null,
     "spes clips at max_grad_norm from the first step"},
    {"max_grad_norm_ratio", "null", is_null, "spes clips the global norm at max_grad_norm"},
    {"load_path", "null", is_null,
     "spes cannot read OLMo training checkpoints: convert the weights (spes import-hf) and set "
     "model.init_checkpoint, or resume a spes run with --resume"},
    {"data.memmap_dtype", "uint32", [](const YAML::Node& v) { return scalar_is(v, "uint32"); },
     "headerless token files are read as little-endian uint32 (the reference's format)"},
    {"data.datasets", "null", is_null, "list the token files in data.paths"},
    {"data.label_mask_paths", "null", is_null, "spes trains on every token"},
    {"data.custom_dataset", "null", is_null, "spes reads token files (data.paths)"},
    {"data.generate_attention_mask", "false", is_false, "spes windows have no padding to mask"},
    {"data.generate_doc_lengths", "false", is_false,
     "spes attention is causal over the whole window (no per-document masking)"},
    {"spes_config.quant_non_local_trainable_experts", "false", is_false,
     "frozen experts are stored in bf16 under precision amp_bf16 (fp32 otherwise), never "
     "quantised further"},
    {"spes_config.using_decayed_aux_loss", "false", is_false,
     "the load-balancing loss covers every expert with one weight (model.moe_loss_weight)"},
};

// Mapped keys where OLMo's null means "unset": the value this project uses for unset, or
// nullptr when the null meaning is not implemented (then `why` says so).
struct NullMeaning {
  const char* key;
  const char* unset;
  const char* why;
};
const NullMeaning kNull[] = {
    {"model.mlp_hidden_size", "0", ""},   // mlp_ratio x d_model
    {"model.n_kv_heads", "0", ""},        // n_heads
    {"model.embedding_size", "0", ""},    // vocab_size
    {"model.moe_zloss_weight", "0", ""},  // no router z-loss
    {"scheduler.t_max", "0", ""},         // the run's length
    {"max_grad_norm", "0", ""},           // no clipping
    {"save_interval", "0", ""},           // save at the end only
    {"activation_checkpointing", "none", ""},  // keep every block's activations
    {"model.init_cutoff_factor", nullptr,
     "OLMo's null draws an untruncated normal; spes always truncates (give a number, e.g. 3)"},
};

// Translated keys (handled in code below).
const char* const kTranslated[] = {
    "using_spes", "using_dilico", "softmax_auxiliary_loss", "model.moe_normalize_expert_weights",
    "model.attention_layer_norm", "model.attention_layer_norm_over_head",
    "scheduler.warmup_min_lr"};

std::pair<std::string, std::string> split_key(const std::string& dotted) {
  const auto dot = dotted.find('.');
  if (dot == std::string::npos) return {"", dotted};
  return {dotted.substr(0, dot), dotted.substr(dot + 1)};
}

// The node at a key of at most two names (an undefined node when absent). Const access: never
// inserts into the tree.
YAML::Node find(const YAML::Node& root, const std::string& dotted) {
  const auto [section, name] = split_key(dotted);
  if (section.empty()) return root[name];
  const YAML::Node sec = root[section];
  if (!sec || !sec.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
  return sec[name];
}

void erase(YAML::Node& root, const std::string& dotted) {
  const auto [section, name] = split_key(dotted);
  if (section.empty()) {
    root.remove(name);
    return;
  }
  YAML::Node sec = root[section];
  sec.remove(name);
}

void assign(YAML::Node& root, const std::string& dotted, const YAML::Node& value,
            const std::string& origin) {
  const auto [section, name] = split_key(dotted);
  if (section.empty()) {
    root[name] = value;
    return;
  }
  const YAML::Node existing = find(root, section);
  SPES_CHECK(!existing || existing.IsMap(), "{}: '{}' must be a mapping of keys, found '{}'",
             origin, section, YAML::Dump(existing));
  if (!existing) root[section] = YAML::Node(YAML::NodeType::Map);
  YAML::Node sec = root[section];
  sec[name] = value;
}

std::string shown(const YAML::Node& v) {
  if (v.IsNull()) return "null";
  std::string s = YAML::Dump(v);
  return s.size() > 80 ? s.substr(0, 80) + "..." : s;
}

// Reads a translated key as a boolean, naming it when it is not one.
bool read_bool(const YAML::Node& v, const std::string& key, const std::string& origin) {
  SPES_CHECK(is_true(v) || is_false(v), "{}: key '{}' must be true or false, found '{}'", origin,
             key, shown(v));
  return is_true(v);
}

// Sets this project's key `to` from the reference key `from`, refusing a different value given
// for `to` in the same file (`same` compares the existing node with the new value).
template <class T>
void set_from(YAML::Node& root, const std::string& from, const std::string& to, const T& value,
              const std::string& origin) {
  const YAML::Node existing = find(root, to);
  if (existing) {
    bool same = false;
    try {
      same = existing.IsScalar() && existing.as<T>() == value;
    } catch (const YAML::Exception&) {
    }
    SPES_CHECK(same, "{}: '{}' means {}: {}, but '{}' is also set, to '{}'; keep one of the two",
               origin, from, to, YAML::Dump(YAML::Node(value)), to, shown(existing));
  }
  assign(root, to, YAML::Node(value), origin);
}

// using_spes / using_dilico -> spes_config.mode. The reference's using_dilico trains every
// tensor on every node and averages them at the server: FedAvg here (mode diloco adds DiLoCo's
// outer Nesterov step, which the reference does not take).
void resolve_mode(YAML::Node& root, const std::string& origin) {
  const YAML::Node spes = find(root, "using_spes"), dilico = find(root, "using_dilico");
  if (!spes && !dilico) return;
  const bool use_spes = spes && read_bool(spes, "using_spes", origin);
  const bool use_dilico = dilico && read_bool(dilico, "using_dilico", origin);
  const std::string mode = !use_spes ? "centralized" : (use_dilico ? "fedavg" : "spes");
  // (without using_spes the reference trains alone, every tensor, whatever using_dilico says)
  const std::string from =
      spes && dilico ? "using_spes/using_dilico" : (spes ? "using_spes" : "using_dilico");
  erase(root, "using_spes");
  erase(root, "using_dilico");
  set_from(root, from, "spes_config.mode", mode, origin);
}

// attention_layer_norm (+ attention_layer_norm_over_head) -> model.qk_norm: off -> none, on ->
// whole (RMSNorm over the whole q and k vectors, OLMoE), on and over head -> per_head (Qwen3).
// Without attention_layer_norm in the file, QK-norm is on (this project's default).
void resolve_qk_norm(YAML::Node& root, const std::string& origin) {
  const std::string on_key = "model.attention_layer_norm";
  const std::string head_key = "model.attention_layer_norm_over_head";
  const YAML::Node on = find(root, on_key), over_head = find(root, head_key);
  if (!on && !over_head) return;
  const bool per_head = over_head && read_bool(over_head, head_key, origin);
  const bool norm = on ? read_bool(on, on_key, origin) : true;
  erase(root, on_key);
  erase(root, head_key);
  if (on)
    set_from(root, per_head ? on_key + " + " + head_key : on_key, "model.qk_norm",
             std::string(!norm ? "none" : (per_head ? "per_head" : "whole")), origin);
  else if (per_head)
    set_from(root, head_key, "model.qk_norm", std::string("per_head"), origin);
}

// MegaBlocks' moe_normalize_expert_weights is the p of a p-norm the top-k weights are divided
// by; true (p = 1) makes them sum to 1, which is model.moe_norm_topk_prob.
void resolve_topk_norm(YAML::Node& root, const std::string& origin) {
  const std::string key = "model.moe_normalize_expert_weights";
  const YAML::Node v = find(root, key);
  if (!v) return;
  bool norm = false;
  if (is_null(v) || is_false(v) || is_zero(v)) {
    norm = false;
  } else if (is_true(v) || scalar_is(v, "1") || scalar_is(v, "1.0")) {
    norm = true;
  } else {
    fail("{}: '{}' is {}; spes renormalises the top-k weights to sum 1 (true, the 1-norm) or "
         "keeps the raw probabilities (false); other p-norms are not implemented", origin, key,
         shown(v));
  }
  erase(root, key);
  set_from(root, key, "model.moe_norm_topk_prob", norm, origin);
}

// softmax_auxiliary_loss: whether the output z-loss is on (at model.z_loss_weight, 1e-4 by
// default, the value the reference's loss function uses).
void resolve_z_loss(YAML::Node& root, const std::string& origin) {
  const YAML::Node v = find(root, "softmax_auxiliary_loss");
  if (!v) return;
  const bool on = read_bool(v, "softmax_auxiliary_loss", origin);
  erase(root, "softmax_auxiliary_loss");
  if (!on) set_from(root, "softmax_auxiliary_loss", "model.z_loss_weight", 0.0, origin);
}

// scheduler.warmup_min_lr (an absolute LR) -> scheduler.warmup_start (a fraction of the peak).
void resolve_warmup_min_lr(YAML::Node& root, const std::string& origin) {
  const std::string key = "scheduler.warmup_min_lr";
  const YAML::Node v = find(root, key);
  if (!v) return;
  if (!is_null(v)) {
    double min_lr = 0, peak = 5e-4;
    try {
      min_lr = v.as<double>();
      const YAML::Node lr = find(root, "optimizer.learning_rate");
      if (lr) peak = lr.as<double>();
    } catch (const YAML::Exception&) {
      fail("{}: '{}' and optimizer.learning_rate must be numbers, found '{}'", origin, key,
           shown(v));
    }
    SPES_CHECK(peak > 0 && min_lr >= 0 && min_lr < peak, "{}: '{}' ({}) must be in [0, "
               "optimizer.learning_rate = {})", origin, key, min_lr, peak);
    set_from(root, key, "scheduler.warmup_start", min_lr / peak, origin);
  }
  erase(root, key);
}

// data.seed: OLMo's data-order seed, a key of its own here too (DataConfig::seed); null means
// left out.
void resolve_data_seed(YAML::Node& root, const std::string&) {
  const YAML::Node v = find(root, "data.seed");
  if (v && is_null(v)) erase(root, "data.seed");
}

// block_type: OLMo's dense blocks (sequential, llama) are the dense SwiGLU block here.
void resolve_block_type(YAML::Node& root, const std::string& origin) {
  const YAML::Node v = find(root, "model.block_type");
  if (v && (scalar_is(v, "sequential") || scalar_is(v, "llama")))
    assign(root, "model.block_type", YAML::Node("dense"), origin);
}

}  // namespace

std::vector<std::string> reference_keys_resolve(YAML::Node& root, const std::string& origin) {
  if (!root.IsMap()) return {};
  for (const auto& c : kOneValue) {
    const YAML::Node v = find(root, c.key);
    if (!v) continue;
    SPES_CHECK(c.ok(v), "{}: '{}' is {}; {} (only {} is supported)", origin, c.key, shown(v),
               c.does, c.value);
    erase(root, c.key);
  }
  for (const auto& n : kNull) {
    const YAML::Node v = find(root, n.key);
    if (!v || !v.IsNull()) continue;
    SPES_CHECK(n.unset != nullptr, "{}: '{}' is null; {}", origin, n.key, n.why);
    assign(root, n.key, YAML::Node(n.unset), origin);
  }
  resolve_mode(root, origin);
  resolve_qk_norm(root, origin);
  resolve_topk_norm(root, origin);
  resolve_z_loss(root, origin);
  resolve_warmup_min_lr(root, origin);
  resolve_data_seed(root, origin);
  resolve_block_type(root, origin);

  // Operational keys, in the order the file lists them.
  const std::set<std::string> operational(std::begin(kOperational), std::end(kOperational));
  std::vector<std::string> ignored;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string top = it->first.as<std::string>();
    if (operational.count(top)) ignored.push_back(top);
    if (!it->second.IsMap()) continue;
    for (auto jt = it->second.begin(); jt != it->second.end(); ++jt) {
      const std::string k = top + "." + jt->first.as<std::string>();
      if (operational.count(k)) ignored.push_back(k);
    }
  }
  for (const auto& k : ignored) erase(root, k);
  return ignored;
}

std::vector<std::string> reference_key_names() {
  std::vector<std::string> out(std::begin(kOperational), std::end(kOperational));
  for (const auto& c : kOneValue) out.push_back(c.key);
  for (const char* k : kTranslated) out.push_back(k);
  return out;
}

}  // namespace spes
