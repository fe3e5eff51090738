// Run configuration: model shape, optimizer, schedule, data, training loop and SPES settings.
// Loaded from YAML with the reference SPES/OLMo key names and meanings where the concept is the
// same; `--set key=value` overrides any key. Every struct lists its fields once, in visit(), and
// parsing, emitting and the unknown-key check all read that one list. The reference's other keys
// (translated, accepted at the one value implemented here, operational or refused) are handled
// by io/reference_keys before the fields are read.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "spes/io/choice.h"
#include "spes/io/named_settings.h"

namespace spes {

// The settings that take one of a few names, parsed once (io/choice.h).
enum class SyncMode { Centralized, Spes, Fedavg, Diloco };
enum class TransferDtype { Fp32, Bf16 };
enum class Compression { None, Bf16, Int8, Topk };
enum class WireCoding { Auto, Zstd, Raw };
enum class Weighting { Equal, Tokens };
enum class Aggregation { Mean, TrimmedMean, Median };
enum class QkNorm { Whole, PerHead, None };
enum class BlockType { Moe, Dense };
enum class Precision { Auto, Fp32, AmpBf16 };
enum class OptimizerName { AdamW };
enum class SchedulerName { CosineWithWarmup, Constant };
enum class MomentDtype { Fp32, Bf16, Int8 };

template <> struct ChoiceNames<SyncMode> {
  static constexpr std::array<std::pair<SyncMode, std::string_view>, 4> names{
      {{SyncMode::Centralized, "centralized"}, {SyncMode::Spes, "spes"},
       {SyncMode::Fedavg, "fedavg"}, {SyncMode::Diloco, "diloco"}}};
};
template <> struct ChoiceNames<TransferDtype> {
  static constexpr std::array<std::pair<TransferDtype, std::string_view>, 2> names{
      {{TransferDtype::Fp32, "fp32"}, {TransferDtype::Bf16, "bf16"}}};
};
template <> struct ChoiceNames<Compression> {
  static constexpr std::array<std::pair<Compression, std::string_view>, 4> names{
      {{Compression::None, "none"}, {Compression::Bf16, "bf16"}, {Compression::Int8, "int8"},
       {Compression::Topk, "topk"}}};
};
template <> struct ChoiceNames<WireCoding> {
  static constexpr std::array<std::pair<WireCoding, std::string_view>, 3> names{
      {{WireCoding::Auto, "auto"}, {WireCoding::Zstd, "zstd"}, {WireCoding::Raw, "raw"}}};
};
template <> struct ChoiceNames<Weighting> {
  static constexpr std::array<std::pair<Weighting, std::string_view>, 2> names{
      {{Weighting::Equal, "equal"}, {Weighting::Tokens, "tokens"}}};
};
template <> struct ChoiceNames<Aggregation> {
  static constexpr std::array<std::pair<Aggregation, std::string_view>, 3> names{
      {{Aggregation::Mean, "mean"}, {Aggregation::TrimmedMean, "trimmed_mean"},
       {Aggregation::Median, "median"}}};
};
template <> struct ChoiceNames<QkNorm> {
  static constexpr std::array<std::pair<QkNorm, std::string_view>, 3> names{
      {{QkNorm::Whole, "whole"}, {QkNorm::PerHead, "per_head"}, {QkNorm::None, "none"}}};
};
template <> struct ChoiceNames<MomentDtype> {
  static constexpr std::array<std::pair<MomentDtype, std::string_view>, 3> names{
      {{MomentDtype::Fp32, "fp32"}, {MomentDtype::Bf16, "bf16"}, {MomentDtype::Int8, "int8"}}};
};
template <> struct ChoiceNames<BlockType> {
  static constexpr std::array<std::pair<BlockType, std::string_view>, 2> names{
      {{BlockType::Moe, "moe"}, {BlockType::Dense, "dense"}}};
};
template <> struct ChoiceNames<OptimizerName> {
  static constexpr std::array<std::pair<OptimizerName, std::string_view>, 1> names{
      {{OptimizerName::AdamW, "adamw"}}};
};
template <> struct ChoiceNames<SchedulerName> {
  static constexpr std::array<std::pair<SchedulerName, std::string_view>, 2> names{
      {{SchedulerName::CosineWithWarmup, "cosine_with_warmup"},
       {SchedulerName::Constant, "constant"}}};
};
template <> struct ChoiceNames<Precision> {
  static constexpr std::array<std::pair<Precision, std::string_view>, 3> names{
      {{Precision::Auto, "auto"}, {Precision::Fp32, "fp32"}, {Precision::AmpBf16, "amp_bf16"}}};
};

struct ModelConfig {
  int64_t d_model = 256;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 0;             // 0: same as n_heads (no GQA)
  // OLMo's meaning: the SwiGLU input projection's width, gate and up together, so each expert's
  // (or the dense MLP's) hidden size is F = mlp_hidden_size / 2; 0 (OLMo: null) takes
  // mlp_ratio x d_model instead. See ffn_hidden_size().
  int64_t mlp_hidden_size = 0;
  int64_t mlp_ratio = 4;
  int64_t moe_num_experts = 8;
  int64_t moe_top_k = 2;
  Choice<BlockType> block_type = BlockType::Moe;  // moe | dense
  bool moe_norm_topk_prob = false;    // renormalise the top-k weights to sum 1 (Qwen-MoE style)
  Choice<QkNorm> qk_norm = QkNorm::Whole;  // whole (OLMoE) | per_head (Qwen3) | none
  double rope_theta = 500000.0;
  int64_t vocab_size = 8192;
  int64_t embedding_size = 0;         // rows of the embedding and LM head (>= vocab_size, padding
                                      // the table as OLMo does); 0: vocab_size
  int64_t max_sequence_length = 256;
  double layer_norm_eps = 1e-6;
  double init_std = 0.02;
  double init_cutoff_factor = 3.0;
  double moe_loss_weight = 0.01;      // load-balancing loss weight
  double moe_zloss_weight = 0.001;    // router z-loss weight
  double z_loss_weight = 1e-4;        // output (LM head) z-loss weight
  int64_t eos_token_id = 0;
  int64_t pad_token_id = -1;
  // Start from these weights instead of a random init: a checkpoint directory or a Hugging Face
  // directory (spes import-hf / upcycle output, or an export). Architecture must match.
  std::string init_checkpoint;

  bool is_moe() const { return block_type == BlockType::Moe; }
  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_dim() const { return d_model / n_heads; }
  // F: the hidden size of each expert (or of the dense MLP), OLMo's
  // (mlp_hidden_size or mlp_ratio x d_model) / 2 for SwiGLU.
  int64_t ffn_hidden_size() const { return swiglu_input_size() / 2; }
  int64_t swiglu_input_size() const {
    return mlp_hidden_size > 0 ? mlp_hidden_size : mlp_ratio * d_model;
  }
  // Sets mlp_hidden_size so that ffn_hidden_size() is F.
  void set_ffn_hidden_size(int64_t F) { mlp_hidden_size = 2 * F; }
  // Rows of the embedding table and the LM head (the logits' width).
  int64_t embedding_rows() const { return embedding_size > 0 ? embedding_size : vocab_size; }

  template <class V> void visit(V& v) {
    v("d_model", d_model); v("n_layers", n_layers); v("n_heads", n_heads);
    v("n_kv_heads", n_kv_heads); v("mlp_hidden_size", mlp_hidden_size);
    v("mlp_ratio", mlp_ratio);
    v("moe_num_experts", moe_num_experts); v("moe_top_k", moe_top_k);
    v("block_type", block_type); v("moe_norm_topk_prob", moe_norm_topk_prob);
    v("qk_norm", qk_norm); v("rope_theta", rope_theta); v("vocab_size", vocab_size);
    v("embedding_size", embedding_size);
    v("max_sequence_length", max_sequence_length); v("layer_norm_eps", layer_norm_eps);
    v("init_std", init_std); v("init_cutoff_factor", init_cutoff_factor);
    v("moe_loss_weight", moe_loss_weight); v("moe_zloss_weight", moe_zloss_weight);
    v("z_loss_weight", z_loss_weight); v("eos_token_id", eos_token_id);
    v("pad_token_id", pad_token_id); v("init_checkpoint", init_checkpoint);
  }
};

struct OptimizerConfig {
  Choice<OptimizerName> name = OptimizerName::AdamW;
  double learning_rate = 5e-4;
  double weight_decay = 0.1;
  std::vector<double> betas = {0.9, 0.95};
  double eps = 1e-8;
  // Storage of AdamW's two moments (train/adamw_moments.h): fp32, bf16 or int8 (8-bit block-wise).
  Choice<MomentDtype> moment_dtype = MomentDtype::Fp32;
  template <class V> void visit(V& v) {
    v("name", name); v("learning_rate", learning_rate); v("weight_decay", weight_decay);
    v("betas", betas); v("eps", eps); v("moment_dtype", moment_dtype);
  }
};

struct SchedulerConfig {
  Choice<SchedulerName> name = SchedulerName::CosineWithWarmup;  // cosine_with_warmup | constant
  int64_t t_warmup = 2000;
  int64_t t_max = 0;                        // 0: the run's total steps
  double alpha_f = 0.1;                     // final LR = alpha_f * peak
  double warmup_start = 0.1;                // warm-up starts at warmup_start * peak
  template <class V> void visit(V& v) {
    v("name", name); v("t_warmup", t_warmup); v("t_max", t_max); v("alpha_f", alpha_f);
    v("warmup_start", warmup_start);
  }
};

struct DataConfig {
  std::vector<std::string> paths;       // token shard files or a prepared directory (manifest)
  std::string tokenizer;                // tokenizer file used to prepare the data (for samples)
  double validation_fraction = 0.01;    // held-out windows (taken from the end of the corpus)
  std::vector<std::string> validation_paths;  // explicit validation shards (overrides fraction)
  bool split_across_nodes = false;      // give each node a disjoint slice of the windows
  // OLMo's data.seed: this node's data-order seed as written (the top-level `seed` then seeds
  // only the initial model); -1: the order follows `seed` (node i: seed + 1000 i).
  int64_t seed = -1;
  template <class V> void visit(V& v) {
    v("paths", paths); v("tokenizer", tokenizer); v("validation_fraction", validation_fraction);
    v("validation_paths", validation_paths); v("split_across_nodes", split_across_nodes);
    v("seed", seed);
  }
};

// spes_config: the SPES settings. In YAML every key is flat (`spes_config.round_timeout`, the
// reference's names); in C++ the settings that belong together form small groups, each listing
// its keys in its own visit().

// Transport and security: where the server is, how a node proves who it is, TLS, retries.
struct SyncTransport {
  std::string server_addr = "127.0.0.1:50551";
  std::string auth_tokens_file;         // YAML/JSON map node id -> secret token ("": no auth)
  std::string tls_cert, tls_key;        // server: PEM certificate chain and key (TLS on)
  std::string tls_client_ca;            // server: require client certificates signed by this
  std::string tls_ca;                   // node: PEM roots to verify the server (TLS on)
  std::string tls_client_cert, tls_client_key;  // node: its certificate (optional)
  double retry_max_s = 600.0;           // node: keep retrying an unreachable server this long
  double retry_backoff_max_s = 5.0;     // node: longest pause between retries
  template <class V> void visit(V& v) {
    v("server_addr", server_addr); v("auth_tokens_file", auth_tokens_file);
    v("tls_cert", tls_cert); v("tls_key", tls_key); v("tls_client_ca", tls_client_ca);
    v("tls_ca", tls_ca); v("tls_client_cert", tls_client_cert);
    v("tls_client_key", tls_client_key); v("retry_max_s", retry_max_s);
    v("retry_backoff_max_s", retry_backoff_max_s);
  }
};

// Round timing: how long a round waits, how many uploads it needs, when a node counts as dead,
// and whether a node trains on while its round is in flight.
struct RoundTiming {
  double round_timeout = 600.0;         // seconds a round waits for stragglers
  int64_t min_nodes = 2;                // uploads a round needs to publish at its deadline (at
                                        // most the nodes joined and alive; sync/server/open_round.h)
  double heartbeat_timeout = 60.0;      // seconds of silence after which a node is dead
  // Node: keep training while a round is in flight and apply the published model, plus the
  // progress made meanwhile, when it arrives (docs/PROTOCOL.md, "Overlap"); with
  // overlap_delay_steps K > 0 exactly K steps after the upload instead (bit-reproducible).
  bool overlap = false;
  int64_t overlap_delay_steps = 0;
  template <class V> void visit(V& v) {
    v("round_timeout", round_timeout); v("min_nodes", min_nodes);
    v("heartbeat_timeout", heartbeat_timeout); v("overlap", overlap);
    v("overlap_delay_steps", overlap_delay_steps);
  }
};

// Compression: what a round's tensors travel as.
struct TransferSettings {
  Choice<TransferDtype> dtype = TransferDtype::Fp32;      // transfer_dtype: fp32 | bf16
  Choice<Compression> compression = Compression::None;  // none | bf16 | int8 | topk: deltas
  // compression: topk (sync/wire/topk_kernels.h): per chunk of 4096 values at most
  // ceil(topk_density x 4096) entries, of topk_bits bits each (2..4), and the node's
  // error-feedback accumulator decayed by topk_decay before each round's change is added
  // (1: plain error feedback; SparseLoCo's beta below 1). topk_down_density: the density of
  // the change the server publishes for averaged (shared) tensors, with its own residual
  // (0: topk_density; an owner's expert is published as uploaded, at topk_density).
  double topk_density = 1.0 / 64;
  int64_t topk_bits = 2;
  double topk_decay = 1.0;
  double topk_down_density = 0;
  // Node, compression topk (ignored otherwise): true = after each round it trains on the
  // published model plus what it has not sent yet (its accumulator; sync/round/delta_upload.h),
  // so its own change is never delayed for itself; false = on the published model alone. A
  // node's own choice (the published model is the same either way); docs/RESULTS.md, "Training
  // on what was not sent", measures it.
  bool topk_unsent_in_weights = true;
  // Node: lossless zstd coding of its transfer chunks, both ways (sync/wire/chunk_coding.h):
  // auto = with compression bf16 or int8 (made for slow links), zstd = always, raw = never.
  Choice<WireCoding> wire_coding = WireCoding::Auto;
  template <class V> void visit(V& v) {
    v("transfer_dtype", dtype); v("compression", compression); v("wire_coding", wire_coding);
    v("topk_density", topk_density); v("topk_bits", topk_bits); v("topk_decay", topk_decay);
    v("topk_down_density", topk_down_density);
    v("topk_unsent_in_weights", topk_unsent_in_weights);
  }
  // Whether a node codes its transfer chunks with zstd (wire_coding).
  bool codes_chunks() const {
    return wire_coding == WireCoding::Zstd ||
           (wire_coding == WireCoding::Auto && compression != Compression::None);
  }
};

// The expert-merging warm-up (sync/round/merge.h): at merge steps (every `interval` steps),
// alpha = alpha_start x max(0, 1 - step / decay_steps), `topk` donors per expert.
struct MergeSettings {
  int64_t interval = 500;               // merge_interval; 0 disables expert merging
  double alpha_start = 0.01;            // merge_alpha_start
  int64_t decay_steps = 10000;          // merge_decay_steps
  int64_t topk = 4;                     // merge_topk
  template <class V> void visit(V& v) {
    v("merge_interval", interval); v("merge_alpha_start", alpha_start);
    v("merge_decay_steps", decay_steps); v("merge_topk", topk);
  }
};

// DiLoCo's outer Nesterov step on the averaged pseudo-gradient (server side): mode diloco
// applies it to every tensor; mode spes with outer_step: true to the shared tensors (the
// averaged ones; an expert is still its owner's copy).
struct OuterStepSettings {
  double lr = 0.7;                      // outer_lr
  double momentum = 0.9;                // outer_momentum
  bool on_shared = false;               // outer_step (mode spes)
  template <class V> void visit(V& v) {
    v("outer_lr", lr); v("outer_momentum", momentum); v("outer_step", on_shared);
  }
};

// Robust aggregation (docs/SECURITY.md): what one upload may change, and how shared tensors
// are combined. ||upload - published|| at most max_update_norm_ratio x ||published|| over the
// whole upload, and per tensor at most max_tensor_update_ratio x ||published_t|| (0: off); over
// the last drift_window_rounds rounds, a tensor's path from the published value at the window's
// start at most max_drift_ratio x its norm (0: off); a shared tensor's update above
// outlier_factor x the median of the other nodes' updates of it is refused (0: off; needs 2 or
// more uploads); the statistic that combines shared tensors. Over the whole run, an expert
// tensor's norm at most max_expert_peer_ratio x the median norm of the same tensor of the
// layer's other experts, and at most max_expert_growth x its own norm at the run's start (0:
// off; sync/server/expert_drift.h).
struct UpdateBounds {
  double max_update_norm_ratio = 10.0;
  double max_tensor_update_ratio = 10.0;
  int64_t drift_window_rounds = 10;
  double max_drift_ratio = 20.0;
  double outlier_factor = 8.0;
  double max_expert_peer_ratio = 4.0;
  double max_expert_growth = 16.0;
  Choice<Aggregation> aggregation = Aggregation::Mean;  // mean | trimmed_mean | median (shared)
  double trim_fraction = 0.25;          // trimmed_mean: share of nodes dropped at each end
  template <class V> void visit(V& v) {
    v("max_update_norm_ratio", max_update_norm_ratio);
    v("max_tensor_update_ratio", max_tensor_update_ratio);
    v("drift_window_rounds", drift_window_rounds); v("max_drift_ratio", max_drift_ratio);
    v("outlier_factor", outlier_factor); v("aggregation", aggregation);
    v("max_expert_peer_ratio", max_expert_peer_ratio); v("max_expert_growth", max_expert_growth);
    v("trim_fraction", trim_fraction);
  }
};

// The sync server's status page (docs/DASHBOARD.md).
struct DashboardSettings {
  int64_t port = 0;                     // dashboard_port: -1 off, 0 any free port, N that port
  std::string host = "127.0.0.1";       // dashboard_host: the address the page binds
  template <class V> void visit(V& v) { v("dashboard_port", port); v("dashboard_host", host); }
};

// Elastic expert ownership (sync/round/reassign.h, docs/PROTOCOL.md "Ownership epochs"): a
// node that misses reassign_after_rounds consecutive rounds (or leaves "departing") is
// declared departed and its experts go to live nodes at the next round boundary (0: never, the
// map stays the config's for the whole run); expert_capacity (node side, sent on Join) caps
// how many experts per layer the node takes (0: no cap declared); memory_capacity_gib (node
// side, sent on Join) is the memory the node can train in, GiB (0: not declared), which the
// server turns into experts per layer with model/memory_estimate (the smaller cap counts);
// max_memory_capacity_gib (server side) is the largest declaration the server believes.
// max_nodes (issue 38 item 6): node ids admitted in all, num_peers being the initial nodes;
// ids in [num_peers, max_nodes) may arrive mid-run (`spes node --join-new`); 0: num_peers (no
// arrivals). A must-match Join setting (with data.split_across_nodes the slices are over it).
struct ElasticOwnership {
  int64_t reassign_after_rounds = 3;
  int64_t expert_capacity = 0;
  double memory_capacity_gib = 0;
  double max_memory_capacity_gib = 16384;
  int64_t max_nodes = 0;
  template <class V> void visit(V& v) {
    v("reassign_after_rounds", reassign_after_rounds); v("expert_capacity", expert_capacity);
    v("memory_capacity_gib", memory_capacity_gib);
    v("max_memory_capacity_gib", max_memory_capacity_gib);
    v("max_nodes", max_nodes);
  }
};

struct SpesConfig {
  // Who trains what, and how often the nodes sync.
  Choice<SyncMode> mode = SyncMode::Centralized;  // centralized | spes | fedavg | diloco
  int64_t num_peers = 1;
  int64_t peer_id = 0;
  int64_t num_train_experts_per_node = 0;  // 0: E / num_peers (contiguous blocks)
  std::vector<std::vector<int64_t>> expert_owners;  // [layer][expert] -> node; one row = all layers
  int64_t sync_steps = 100;
  Choice<Weighting> weighting = Weighting::Equal;  // equal | tokens
  SyncTransport transport;
  RoundTiming timing;
  TransferSettings transfer;
  MergeSettings merging;
  OuterStepSettings outer;
  UpdateBounds bounds;
  DashboardSettings dashboard;
  ElasticOwnership elastic;
  // issue 38 (own-node): steps of the learning-rate re-warm-up of experts a node gains without
  // their AdamW moments (Trainer::change_ownership): linear from 1/n to 1 over n optimizer
  // steps; -1: the scheduler's t_warmup; 0: none.
  int64_t rewarmup_steps = -1;
  template <class V> void visit(V& v) {
    v("mode", mode); v("num_peers", num_peers); v("peer_id", peer_id);
    v("num_train_experts_per_node", num_train_experts_per_node);
    v("expert_owners", expert_owners); v("sync_steps", sync_steps);
    v("weighting", weighting);
    v("rewarmup_steps", rewarmup_steps);  // issue 38 (own-node)
    transport.visit(v); timing.visit(v); transfer.visit(v); merging.visit(v); outer.visit(v);
    bounds.visit(v); dashboard.visit(v); elastic.visit(v);
  }
  // Node ids the run admits: [0, num_peers) start it, [num_peers, node_slots()) may arrive.
  int64_t node_slots() const { return elastic.max_nodes > 0 ? elastic.max_nodes : num_peers; }
  // Whether the server applies the outer step (and keeps its momentum).
  bool uses_outer_step() const {
    return mode == SyncMode::Diloco || (mode == SyncMode::Spes && outer.on_shared);
  }
};

struct Config {
  ModelConfig model;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  DataConfig data;
  SpesConfig spes_config;
  std::string run_name = "spes";
  std::string max_duration = "1000";    // steps; "Nba" (batches) or "NT" (tokens) also accepted
  int64_t global_train_batch_size = 8;  // sequences per optimizer step
  int64_t device_train_microbatch_size = 8;  // sequences per forward/backward
  int64_t seed = 6198;
  double max_grad_norm = 1.0;
  Choice<Precision> precision = Precision::Auto;  // auto | fp32 | amp_bf16 (bf16 autocast)
  DeviceSetting device;                 // auto | cpu | cuda | cuda:N
  // Recompute block activations in backward instead of keeping them (OLMo's key): none (or
  // false) | whole_layer (or true): every block | one_in_two | one_in_three | one_in_four.
  ActivationCheckpointing activation_checkpointing;
  int64_t threads = 0;  // CPU threads; 0: all cores. A step with several micro-batches runs
                        // them one per thread at once (train/micro_batch_workers.h)
  int64_t eval_interval = 100;          // steps between validation evaluations (0: only at end)
  int64_t eval_batches = 16;            // micro-batches per validation evaluation (0: all)
  int64_t save_interval = 0;            // steps between checkpoints (0: only at end)
  int64_t save_num_checkpoints_to_keep = 2;
  std::vector<std::string> frozen_experts;  // "layer:expert", "*:expert" or "layer:*"

  template <class V> void visit(V& v) {
    v.section("model", model); v.section("optimizer", optimizer);
    v.section("scheduler", scheduler); v.section("data", data);
    v.section("spes_config", spes_config);
    v("run_name", run_name); v("max_duration", max_duration);
    v("global_train_batch_size", global_train_batch_size);
    v("device_train_microbatch_size", device_train_microbatch_size);
    v("seed", seed); v("max_grad_norm", max_grad_norm); v("precision", precision);
    v("device", device); v("activation_checkpointing", activation_checkpointing);
    v("threads", threads); v("eval_interval", eval_interval);
    v("eval_batches", eval_batches); v("save_interval", save_interval);
    v("save_num_checkpoints_to_keep", save_num_checkpoints_to_keep);
    v("frozen_experts", frozen_experts);
  }

  // Total optimizer steps implied by max_duration.
  int64_t total_steps() const;
  int64_t grad_accum_steps() const { return global_train_batch_size / device_train_microbatch_size; }
  int64_t tokens_per_step() const { return global_train_batch_size * model.max_sequence_length; }
};

// Loads a YAML file (empty path: built-in defaults), applies `key=value` overrides and checks
// every value. Throws spes::Error naming the file, key and expected value on any problem.
// path empty: the built-in default, configs/default.yaml as compiled in. Operational keys of a
// reference config (fsdp, wandb, save_folder, stop_at, ...) are named in one warning line and
// also returned in `ignored_keys` when given (io/reference_keys.h).
Config config_load(const std::string& path, const std::vector<std::string>& overrides = {},
                   std::vector<std::string>* ignored_keys = nullptr);
const char* builtin_default_config_yaml();
// Same, from YAML text (`origin` names it in errors).
Config config_parse(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& origin, std::vector<std::string>* ignored_keys = nullptr);
// The whole config as YAML; config_parse(config_to_yaml(c), {}, ..) reproduces c.
std::string config_to_yaml(const Config& c);
// Checks cross-field consistency (sizes divide, ranges). Called by the loaders.
void config_validate(const Config& c, const std::string& origin);

}  // namespace spes
