// Reference (OLMo/SPES) training YAMLs load as the reference's model: the three configs in
// configs/reference/ give the parameter counts OLMo's own formulas give (tests/io/
// olmo_param_counts.py, and the figures worked out by hand in the table below), per node too
// (expert e belongs to node e / m: in the 9B run nodes 4-7 own no expert); every key of OLMo's
// TrainConfig is mapped, ignored with the one warning, or refused by name, never "unknown";
// `spes config --json` reports the counts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "interop/cli_run.h"
#include "python_reference.h"
#include "spes/common/error.h"
#include "spes/io/config.h"
#include "spes/model/ownership.h"
#include "spes/model/param_counts.h"
#include "spes/model/transformer.h"

using namespace spes;
using ::testing::HasSubstr;
using json = nlohmann::json;

namespace {

std::string reference_config(const std::string& name) {
  return std::string(SPES_SOURCE_DIR) + "/configs/reference/" + name;
}

struct Expected {
  const char* file;
  int64_t total, active;
  std::vector<int64_t> trainable;  // per node
};

// Worked out by hand from OLMo's module shapes (see olmo_param_counts.py), e.g. the 1B model:
// wte and ff_out 151665 x 768 each; per layer att_proj 768 x 2304, attn_out 768 x 768, q/k norm
// 768 each, two block norms 768 each, router 16 x 768, experts 3 x 16 x 2048 x 768; ln_f 768.
const std::vector<Expected> kExpected = {
    {"spes_moe_1b_4nodes.yaml", 1167423744, 374700288, std::vector<int64_t>(4, 487946496)},
    {"spes_moe_1b_7b_4nodes.yaml", 7333287936, 1696143360, std::vector<int64_t>(4, 2501449728)},
    {"spes_moe_3b_9b_8nodes.yaml", 9430950912, 3089163264,
     {3089163264, 3089163264, 3089163264, 3089163264, 975234048, 975234048, 975234048,
      975234048}},
};

std::string error_of(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  try {
    config_parse(yaml, sets, "ref.yaml");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ReferenceConfig, CountsMatchOlmoFormulas) {
  for (const auto& want : kExpected) {
    SCOPED_TRACE(want.file);
    const std::string path = reference_config(want.file);
    const json olmo = json::parse(
        spes::test::run_python_reference("io/olmo_param_counts.py", {path}));
    // The script and the hand-worked figures agree...
    EXPECT_EQ(olmo["total"].get<int64_t>(), want.total);
    EXPECT_EQ(olmo["active_per_token"].get<int64_t>(), want.active);
    EXPECT_EQ(olmo["trainable_per_node"].get<std::vector<int64_t>>(), want.trainable);
    // ...and so does the model this project builds from the file, on every node.
    const Config cfg = config_load(path);
    EXPECT_EQ(cfg.model.ffn_hidden_size(), olmo["ffn_hidden_size"].get<int64_t>());
    EXPECT_EQ(cfg.model.embedding_rows(), olmo["embedding_rows"].get<int64_t>());
    ASSERT_EQ(cfg.spes_config.num_peers, static_cast<int64_t>(want.trainable.size()));
    for (int64_t node = 0; node < cfg.spes_config.num_peers; ++node) {
      const ParamCounts c = param_counts(cfg, node);
      EXPECT_EQ(c.total, want.total) << "node " << node;
      EXPECT_EQ(c.active_per_token, want.active) << "node " << node;
      EXPECT_EQ(c.trainable, want.trainable[node]) << "node " << node;
    }
  }
}

TEST(ReferenceConfig, ModelsAreTheReferenceModels) {
  const Config b1 = config_load(reference_config("spes_moe_1b_4nodes.yaml"));
  EXPECT_EQ(b1.model.ffn_hidden_size(), 2048);  // mlp_hidden_size 4096 / 2
  EXPECT_EQ(b1.model.qk_norm, "whole");
  EXPECT_FALSE(b1.model.moe_norm_topk_prob);
  EXPECT_EQ(b1.model.rope_theta, 500000);
  EXPECT_EQ(b1.spes_config.mode, "spes");
  EXPECT_EQ(b1.spes_config.sync_steps, 100);
  EXPECT_DOUBLE_EQ(b1.model.z_loss_weight, 1e-4);  // softmax_auxiliary_loss: true
  EXPECT_EQ(b1.precision, "amp_bf16");
  EXPECT_EQ(b1.scheduler.t_max, 50000);

  const Config b7 = config_load(reference_config("spes_moe_1b_7b_4nodes.yaml"));
  EXPECT_EQ(b7.model.d_model, 2048);
  EXPECT_EQ(b7.model.n_layers, 16);
  EXPECT_EQ(b7.model.moe_num_experts, 32);
  EXPECT_EQ(b7.model.moe_top_k, 4);
  EXPECT_EQ(b7.model.ffn_hidden_size(), 2048);  // not 4096: OLMo's meaning of mlp_hidden_size
  EXPECT_EQ(b7.model.rope_theta, 32000);

  const Config b9 = config_load(reference_config("spes_moe_3b_9b_8nodes.yaml"));
  EXPECT_EQ(b9.model.n_layers, 28);
  EXPECT_EQ(b9.model.n_heads, 16);
  EXPECT_EQ(b9.model.kv_heads(), 8);
  EXPECT_EQ(b9.model.ffn_hidden_size(), 6144);  // mlp_ratio 6 x 2048 / 2
  EXPECT_EQ(b9.model.qk_norm, "per_head");      // attention_layer_norm_over_head
  EXPECT_TRUE(b9.model.moe_norm_topk_prob);     // moe_normalize_expert_weights
  EXPECT_EQ(b9.model.vocab_size, 151665);
  EXPECT_EQ(b9.model.embedding_rows(), 151936);
  EXPECT_EQ(b9.model.rope_theta, 1e6);
  // The model itself: padded tables and per-head norms.
  const Transformer m(b9.model, torch::Device(torch::kMeta));
  for (const auto& p : m.params()) {
    if (p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight")
      EXPECT_EQ(p.tensor.sizes(), (c10::IntArrayRef{151936, 2048})) << p.name;
    if (p.name == "model.layers.0.self_attn.k_norm.weight")
      EXPECT_EQ(p.tensor.size(0), 128);
    if (p.name == "model.layers.0.mlp.experts.7.down_proj.weight")
      EXPECT_EQ(p.tensor.sizes(), (c10::IntArrayRef{2048, 6144}));
  }
  // Expert e belongs to node e / 2: nodes 4-7 own none.
  const Ownership own = Ownership::from_config(b9);
  for (int64_t node = 0; node < 8; ++node) {
    const std::vector<int64_t> want =
        node < 4 ? std::vector<int64_t>{2 * node, 2 * node + 1} : std::vector<int64_t>{};
    EXPECT_EQ(own.experts_of(node, 27), want) << "node " << node;
  }
}

// The reference's four node YAMLs of the 1B run load with the seeds they give: `seed` 6198
// for the initial model on every node, data.seed 6198 + 1000 x node for the data order.
TEST(ReferenceConfig, NodeYamlsLoadWithTheSeedsTheyGive) {
  for (int node = 0; node < 4; ++node) {
    const std::string file = node == 0 ? "spes_moe_1b_4nodes.yaml"
                                       : "spes_moe_1b_4nodes_node" + std::to_string(node) + ".yaml";
    const Config c = config_load(reference_config(file));
    EXPECT_EQ(c.seed, 6198) << file;
    EXPECT_EQ(c.data.seed, 6198 + 1000 * node) << file;
    EXPECT_EQ(c.spes_config.peer_id, node) << file;
    EXPECT_EQ(c.spes_config.num_peers, 4) << file;
  }
  EXPECT_EQ(config_load("", {"data.seed=null"}).data.seed, -1);  // null: left out
  EXPECT_THAT(error_of("", {"data.seed=-5"}), HasSubstr("data.seed must be a non-negative"));
}

TEST(ReferenceConfig, OperationalKeysAreNamedInOneWarning) {
  std::vector<std::string> ignored;
  config_load(reference_config("spes_moe_1b_4nodes.yaml"), {}, &ignored);
  for (const char* k : {"wandb", "fsdp", "save_folder", "stop_at", "distributed_strategy",
                        "evaluators", "tokenizer", "model.flash_attention", "data.num_workers",
                        "data.instance_filter", "auxiliary_loss_multiplier"})
    EXPECT_NE(std::find(ignored.begin(), ignored.end(), k), ignored.end()) << k;
  // Mapped keys are not in it: neither this project's fields nor the accepted one-value keys.
  for (const char* k : {"model.d_model", "model.weight_tying", "using_spes",
                        "model.mlp_hidden_size", "model.attention_layer_norm",
                        "softmax_auxiliary_loss", "data.seed"})
    EXPECT_EQ(std::find(ignored.begin(), ignored.end(), k), ignored.end()) << k;
  // This project's own configs have none.
  config_load("", {}, &ignored);
  EXPECT_TRUE(ignored.empty());
}

// OLMo's TrainConfig keys (spes/config.py of the reference), each with a value a reference
// config may hold: every one is read, accepted or refused by name; none is unknown.
TEST(ReferenceConfig, EveryOlmoKeyIsClassified) {
  const std::vector<std::pair<std::string, std::string>> keys = {
      {"run_name", "x"}, {"seed", "6198"}, {"epoch", "null"}, {"dry_run", "false"},
      {"using_spes", "true"}, {"using_dilico", "false"}, {"restore_dataloader", "true"},
      {"fast_forward_batches", "null"}, {"evaluators", "[]"}, {"eval_interval", "1000"},
      {"save_folder", "./"}, {"remote_save_folder", "null"}, {"canceled_check_interval", "50"},
      {"save_interval", "1000"}, {"save_interval_unsharded", "null"},
      {"save_interval_ephemeral", "null"}, {"save_num_checkpoints_to_keep", "-1"},
      {"save_num_unsharded_checkpoints_to_keep", "-1"}, {"save_overwrite", "false"},
      {"force_save_unsharded", "false"}, {"no_pre_train_checkpoint", "false"},
      {"load_path", "null"}, {"load_path_sharded_checkpointer", "null"},
      {"try_load_latest_save", "false"}, {"reset_optimizer_state", "false"},
      {"reset_trainer_state", "false"}, {"sharded_checkpointer", "torch_legacy"},
      {"new_style_checkpoints", "null"}, {"max_duration", "10000"},
      {"global_train_batch_size", "512"}, {"device_train_batch_size", "null"},
      {"device_train_microbatch_size", "16"}, {"device_eval_batch_size", "16"},
      {"eval_subset_num_batches", "-1"}, {"eval_on_load", "false"},
      {"device_train_grad_accum", "null"}, {"max_grad_norm", "null"},
      {"max_grad_norm_ratio", "null"}, {"precision", "amp_bf16"}, {"wandb", "null"},
      {"speed_monitor", "{window_size: 100}"}, {"console_log_interval", "1"},
      {"gen1_gc_interval", "1"}, {"compile", "null"}, {"distributed_strategy", "fsdp"},
      {"fsdp", "{precision: mixed}"}, {"ddp", "null"}, {"single", "{device: auto}"},
      {"softmax_auxiliary_loss", "false"}, {"auxiliary_loss_multiplier", "1e-4"},
      {"time_limit", "null"}, {"extra_steps_after_cancel", "10"},
      {"early_stopping_factor", "null"}, {"save_data_indices", "true"},
      {"python_profiling", "false"}, {"torch_profiling", "false"}, {"stop_at", "null"},
      {"stop_after", "null"}, {"activation_checkpointing", "null"}, {"fused_loss", "null"},
      {"hf_datasets_cache_dir", "null"}, {"module_outputs_save_steps", "null"},
      {"tokenizer", "{identifier: gpt2}"},
      // spes_config
      {"spes_config.server_addr", "127.0.0.1:50051"}, {"spes_config.num_peers", "5"},
      {"spes_config.peer_id", "0"}, {"spes_config.num_train_experts_per_node", "1"},
      {"spes_config.quant_non_local_trainable_experts", "false"},
      {"spes_config.sync_steps", "100"}, {"spes_config.using_decayed_aux_loss", "false"},
      {"spes_config.decayed_factor_update_steps", "500"},
      // model
      {"model.d_model", "768"}, {"model.n_heads", "12"}, {"model.n_kv_heads", "null"},
      {"model.clip_qkv", "null"}, {"model.n_layers", "12"}, {"model.mlp_ratio", "4"},
      {"model.mlp_hidden_size", "null"}, {"model.activation_type", "swiglu"},
      {"model.block_type", "moe"}, {"model.block_group_size", "1"}, {"model.alibi", "false"},
      {"model.alibi_bias_max", "8.0"}, {"model.rope", "true"},
      {"model.rope_full_precision", "true"}, {"model.rope_theta", "10000"},
      {"model.flash_attention", "false"}, {"model.attention_dropout", "0.0"},
      {"model.multi_query_attention", "null"}, {"model.attention_layer_norm", "true"},
      {"model.attention_layer_norm_over_head", "false"}, {"model.residual_dropout", "0.0"},
      {"model.embedding_dropout", "0.0"}, {"model.embedding_layer_norm", "false"},
      {"model.layer_norm_type", "rms"}, {"model.layer_norm_with_affine", "true"},
      {"model.layer_norm_eps", "1e-05"}, {"model.attention_layer_norm_with_affine", "true"},
      {"model.max_sequence_length", "1024"}, {"model.include_bias", "false"},
      {"model.bias_for_layer_norm", "null"}, {"model.scale_logits", "false"},
      {"model.vocab_size", "50257"}, {"model.embedding_size", "50304"},
      {"model.weight_tying", "false"}, {"model.eos_token_id", "50256"},
      {"model.pad_token_id", "50256"}, {"model.init_device", "null"},
      {"model.init_fn", "normal"}, {"model.init_std", "0.02"},
      {"model.init_cutoff_factor", "3"}, {"model.precision", "null"},
      {"model.moe_num_experts", "8"}, {"model.moe_top_k", "2"},
      {"model.using_custom_moe_impl", "false"}, {"model.moe_mlp_impl", "sparse"},
      {"model.moe_log_expert_assignment", "true"},
      {"model.moe_normalize_expert_weights", "false"}, {"model.moe_shared_expert", "false"},
      {"model.moe_lbl_in_fp32", "false"}, {"model.moe_loss_weight", "0.1"},
      {"model.moe_zloss_weight", "null"}, {"model.moe_dropless", "true"},
      {"model.moe_capacity_factor", "1.25"}, {"model.scale_emb_init", "false"},
      {"model.emb_init_std", "null"}, {"model.norm_after", "false"},
      // optimizer, scheduler
      {"optimizer.name", "adamw"}, {"optimizer.learning_rate", "1.0e-4"},
      {"optimizer.weight_decay", "0.01"}, {"optimizer.betas", "[0.9, 0.95]"},
      {"optimizer.eps", "1e-5"}, {"optimizer.no_decay_norm_and_bias", "null"},
      {"optimizer.selective_updates", "false"}, {"optimizer.decay_norm_and_bias", "true"},
      {"optimizer.decay_embeddings", "true"}, {"optimizer.metrics_log_interval", "null"},
      {"optimizer.record_update_metrics", "false"},
      {"scheduler.name", "cosine_with_warmup"}, {"scheduler.units", "steps"},
      {"scheduler.t_warmup", "100"}, {"scheduler.t_max", "null"}, {"scheduler.alpha_f", "0.1"},
      {"scheduler.grad_clip_warmup_steps", "null"},
      {"scheduler.grad_clip_warmup_factor", "null"}, {"scheduler.warmup_min_lr", "null"},
      // data
      {"data.paths", "[a.npy]"}, {"data.memmap_dtype", "uint32"}, {"data.datasets", "null"},
      {"data.label_mask_paths", "null"}, {"data.pad_direction", "right"},
      {"data.generate_attention_mask", "false"}, {"data.generate_doc_lengths", "false"},
      {"data.num_workers", "0"}, {"data.drop_last", "false"}, {"data.pin_memory", "false"},
      {"data.prefetch_factor", "null"}, {"data.persistent_workers", "false"},
      {"data.timeout", "0"}, {"data.seed", "null"}, {"data.instance_filter", "null"},
      {"data.custom_dataset", "null"}};
  for (const auto& [key, value] : keys) {
    // Set alone over this project's defaults: read, or refused naming the key (e.g. n_heads 12
    // does not divide d_model 256).
    const std::string err = error_of("", {key + "=" + value});
    EXPECT_EQ(err.find("unknown key"), std::string::npos) << key << ": " << err;
    if (err != "(no error)") EXPECT_THAT(err, HasSubstr(key.substr(key.rfind('.') + 1))) << key;
  }
  // Most of them at once, as a reference file holds them.
  std::vector<std::string> all;
  for (const auto& [key, value] : keys)
    if (key != "model.n_heads" && key != "model.eos_token_id" && key != "model.pad_token_id" &&
        key != "device_train_microbatch_size")
      all.push_back(key + "=" + value);
  EXPECT_EQ(error_of("", all), "(no error)");
}

TEST(ReferenceConfig, KeysThatWouldChangeTheModelAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"model.weight_tying=true", "'model.weight_tying' is true; the LM head is its own"},
      {"model.include_bias=true", "'model.include_bias' is true; spes models have no biases"},
      {"model.activation_type=gelu", "'model.activation_type' is gelu"},
      {"model.layer_norm_type=default", "'model.layer_norm_type' is default"},
      {"model.attention_dropout=0.1", "'model.attention_dropout' is 0.1"},
      {"model.rope=false", "'model.rope' is false"},
      {"model.clip_qkv=8", "'model.clip_qkv' is 8"},
      {"model.moe_dropless=false", "'model.moe_dropless' is false"},
      {"model.init_fn=mitchell", "'model.init_fn' is mitchell"},
      {"model.init_cutoff_factor=null", "'model.init_cutoff_factor' is null"},
      {"model.moe_normalize_expert_weights=2.0", "'model.moe_normalize_expert_weights' is 2.0"},
      {"optimizer.decay_norm_and_bias=false", "'optimizer.decay_norm_and_bias' is false"},
      {"scheduler.units=tokens", "'scheduler.units' is tokens"},
      {"spes_config.using_decayed_aux_loss=true", "'spes_config.using_decayed_aux_loss' is true"},
      {"spes_config.quant_non_local_trainable_experts=true",
       "'spes_config.quant_non_local_trainable_experts' is true"},
      {"load_path=/ckpt/step1000", "'load_path' is /ckpt/step1000; spes cannot read OLMo"},
      {"data.memmap_dtype=uint16", "'data.memmap_dtype' is uint16"},
      {"model.embedding_size=100", "model.embedding_size (100) pads the vocabulary"},
      {"model.mlp_hidden_size=1025", "must be even"},
      {"optimizer.name=lionw", "optimizer.name must be adamw, found 'lionw'"},
  };
  for (const auto& [set, want] : refused) EXPECT_THAT(error_of("", {set}), HasSubstr(want)) << set;
  // A translated key and this project's key for the same thing must agree.
  EXPECT_THAT(error_of("using_spes: true\nspes_config: {mode: fedavg}\n"),
              HasSubstr("'using_spes' means spes_config.mode: spes, but 'spes_config.mode' is "
                        "also set, to 'fedavg'"));
  EXPECT_THAT(error_of("model: {attention_layer_norm: false, qk_norm: whole}\n"),
              HasSubstr("'model.attention_layer_norm' means model.qk_norm: none"));
  // Near misses of reference keys get a suggestion.
  EXPECT_THAT(error_of("model: {moe_normalize_expert_weight: true}\n"),
              HasSubstr("did you mean 'model.moe_normalize_expert_weights'"));
}

TEST(ReferenceConfig, TranslatedKeysTakeOlmosMeaning) {
  auto parse = [](const std::string& yaml, const std::vector<std::string>& sets = {}) {
    return config_parse(yaml, sets, "ref.yaml");
  };
  EXPECT_EQ(parse("model: {attention_layer_norm: false}\n").model.qk_norm, "none");
  EXPECT_EQ(parse("model: {attention_layer_norm: true}\n").model.qk_norm, "whole");
  EXPECT_EQ(parse("model: {attention_layer_norm: true, attention_layer_norm_over_head: true}\n")
                .model.qk_norm, "per_head");
  EXPECT_TRUE(parse("model: {moe_normalize_expert_weights: true}\n").model.moe_norm_topk_prob);
  EXPECT_TRUE(parse("model: {moe_normalize_expert_weights: 1.0}\n").model.moe_norm_topk_prob);
  EXPECT_FALSE(parse("model: {moe_normalize_expert_weights: null}\n").model.moe_norm_topk_prob);
  EXPECT_EQ(parse("using_spes: false\n").spes_config.mode, "centralized");
  EXPECT_EQ(parse("using_spes: true\nusing_dilico: true\n").spes_config.mode, "fedavg");
  EXPECT_EQ(parse("", {"using_spes=true"}).spes_config.mode, "spes");  // --set takes them too
  EXPECT_DOUBLE_EQ(parse("softmax_auxiliary_loss: false\n").model.z_loss_weight, 0.0);
  EXPECT_DOUBLE_EQ(parse("optimizer: {learning_rate: 4.0e-4}\nscheduler: {warmup_min_lr: 1.0e-4}\n")
                       .scheduler.warmup_start, 0.25);
  EXPECT_DOUBLE_EQ(parse("max_grad_norm: null\n").max_grad_norm, 0.0);  // no clipping
  EXPECT_DOUBLE_EQ(parse("model: {moe_zloss_weight: null}\n").model.moe_zloss_weight, 0.0);
  EXPECT_EQ(parse("model: {block_type: sequential}\n").model.block_type, "dense");
  // F: mlp_hidden_size / 2, or mlp_ratio x d_model / 2 when mlp_hidden_size is unset.
  EXPECT_EQ(parse("model: {d_model: 64, mlp_hidden_size: 100}\n").model.ffn_hidden_size(), 50);
  EXPECT_EQ(parse("model: {d_model: 64, mlp_ratio: 6}\n").model.ffn_hidden_size(), 192);
  EXPECT_EQ(parse("model: {d_model: 64, mlp_ratio: 6, mlp_hidden_size: null}\n")
                .model.ffn_hidden_size(), 192);
  EXPECT_EQ(parse("model: {d_model: 64}\n").model.ffn_hidden_size(), 128);  // OLMo's ratio 4
  // using_dilico trains every tensor on every node.
  Config dilico = config_load(reference_config("spes_moe_1b_4nodes.yaml"),
                              {"using_dilico=true", "spes_config.num_train_experts_per_node=16"});
  EXPECT_EQ(dilico.spes_config.mode, "fedavg");
  for (int64_t node = 0; node < 4; ++node) {
    const ParamCounts c = param_counts(dilico, node);
    EXPECT_EQ(c.trainable, c.total) << node;
  }
}

TEST(ReferenceConfig, SpesConfigJsonReportsTheCounts) {
  spes::test::TempDir d;
  const std::string path = reference_config("spes_moe_3b_9b_8nodes.yaml");
  auto r = interop_test::run_spes(d, {"config", "--config", path, "--json", "--set",
                                      "spes_config.peer_id=5"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["node"], 5);
  EXPECT_EQ(j["parameters"]["total"].get<int64_t>(), 9430950912);
  EXPECT_EQ(j["parameters"]["active_per_token"].get<int64_t>(), 3089163264);
  EXPECT_EQ(j["parameters"]["trainable_per_node"].get<int64_t>(), 975234048);  // owns no expert
  const json& mem = j["memory"];
  EXPECT_EQ(mem["gradients"].get<int64_t>(), 4 * 975234048LL);
  EXPECT_EQ(mem["adam_moments"].get<int64_t>(), 8 * 975234048LL);
  EXPECT_EQ(mem["weights_by_dtype"]["fp32"].get<int64_t>(), 4 * 9430950912LL);
  EXPECT_EQ(mem["weights_by_dtype"]["bf16"].get<int64_t>(), 2 * 9430950912LL);  // amp_bf16
  EXPECT_GT(mem["activations"].get<int64_t>(), 0);
  EXPECT_EQ(mem["total"].get<int64_t>(),
            mem["weights"].get<int64_t>() + mem["gradients"].get<int64_t>() +
                mem["adam_moments"].get<int64_t>() + mem["activations"].get<int64_t>() +
                mem["sync_state"].get<int64_t>());
  EXPECT_EQ(mem["sync_state"].get<int64_t>(), 0);  // fp32 rounds without overlap
  // The operational keys are named once, on stderr, and stdout stays one JSON object.
  EXPECT_THAT(r.err, HasSubstr("ignoring"));
  EXPECT_THAT(r.err, HasSubstr("fsdp"));
  EXPECT_THAT(r.err, HasSubstr("stop_at"));
  // The text form names the per-node split.
  r = interop_test::run_spes(d, {"config", "--config", path});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("node 4: 975,234,048 (975.23M); owns no experts"));
  EXPECT_THAT(r.out, HasSubstr("node 0 (this config): 3,089,163,264 (3.09B); owns experts 0-1 of "
                               "every layer"));
  // A refused key: one line naming it, exit 1.
  r = interop_test::run_spes(d, {"config", "--config", path, "--set", "model.weight_tying=true"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("'model.weight_tying' is true"));
}

// The paper's scale on paper (issue 37): the reference 1B-7B SPES node's bytes per round and
// round time at 100 Mbit/s, fp32 against the default top-k setting (report/transfer_formula.h).
TEST(ReferenceConfig, SpesConfigPrintsTheRoundsBytesAndTimeForTopk) {
  spes::test::TempDir d;
  const std::string path = reference_config("spes_moe_1b_7b_4nodes.yaml");
  auto fp32 = interop_test::run_spes(d, {"config", "--config", path, "--json"});
  auto topk = interop_test::run_spes(d, {"config", "--config", path, "--json", "--set",
                                         "spes_config.compression=topk"});
  ASSERT_EQ(fp32.code, 0) << fp32.err;
  ASSERT_EQ(topk.code, 0) << topk.err;
  const json f = json::parse(fp32.out)["transfer"], t = json::parse(topk.out)["transfer"];
  EXPECT_EQ(t["compression"], "topk");
  const double f_bytes = f["upload_bytes"].get<double>() + f["download_bytes"].get<double>();
  const double t_bytes = t["upload_bytes"].get<double>() + t["download_bytes"].get<double>();
  EXPECT_LT(t_bytes * 100, f_bytes);  // at most 1/100 of fp32's bytes
  EXPECT_NEAR(t["round_s_at_100mbit"].get<double>(), 8 * t_bytes / 1e8, 1e-6);
  auto text = interop_test::run_spes(d, {"config", "--config", path, "--set",
                                         "spes_config.compression=topk"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("sync per round, node 0 (compression topk"));
  EXPECT_THAT(text.out, HasSubstr("at 100 Mbit/s: "));
  std::printf("%s", text.out.substr(text.out.find("sync per round")).c_str());
}

}  // namespace
