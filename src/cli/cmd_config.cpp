// `spes config --config FILE [--set k=v ...] [--json]`: loads a config (this project's or a
// reference OLMo/SPES training YAML), prints it resolved into this project's keys, and the
// counts a run of it would have: total parameters, active parameters per token, what each node
// trains, and each node's memory by part (JSON: the config's node, spes_config.peer_id)
// (model/param_counts.h, model/memory_estimate.h). Both are closed-form: no model is built, so
// even the 9B reference config allocates no weights. With a sync mode also this config's node's
// bytes per round (report/transfer_formula.h, spes_config.compression as set, next to fp32)
// and the round's transfer time at 100 and 20 Mbit/s (upload then download).
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <string>
#include <vector>

#include "cli/common_options.h"
#include "cli/command.h"
#include "spes/common/strings.h"
#include "spes/io/config.h"
#include "spes/model/memory_estimate.h"
#include "spes/model/ownership.h"
#include "spes/model/param_counts.h"
#include "spes/report/transfer_formula.h"

namespace {

using spes::NodeMemory;
using spes::ParamCounts;

struct ConfigArgs {
  std::string config;
  std::vector<std::string> sets;
  bool json = false;
};

// 1234567 -> "1,234,567 (1.23M)".
std::string count(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  if (n >= 1000000000) return fmt::format("{} ({:.2f}B)", out, n / 1e9);
  if (n >= 1000000) return fmt::format("{} ({:.2f}M)", out, n / 1e6);
  return out;
}

// "experts 0-3", "experts 0, 5", "no experts" (of layer 0; "per layer" when layers differ).
std::string owned_experts(const spes::Ownership& own, int64_t node) {
  if (own.num_layers() == 0 || own.num_experts() == 0) return "no experts (dense model)";
  const std::vector<int64_t> first = own.experts_of(node, 0);
  for (int64_t l = 1; l < own.num_layers(); ++l)
    if (own.experts_of(node, l) != first) return "its experts of each layer (a per-layer map)";
  if (first.empty()) return "no experts";
  const bool contiguous = first.back() - first.front() + 1 == static_cast<int64_t>(first.size());
  if (contiguous && first.size() > 1)
    return fmt::format("experts {}-{} of every layer", first.front(), first.back());
  std::string list;
  for (int64_t e : first) list += (list.empty() ? "" : ", ") + std::to_string(e);
  return fmt::format("expert{} {} of every layer", first.size() > 1 ? "s" : "", list);
}

// Seconds to move `bytes` at `mbit` Mbit/s.
double transfer_s(int64_t bytes, double mbit) { return 8.0 * static_cast<double>(bytes) / (mbit * 1e6); }

// "node 0 per round (compression topk): up 1.2 GiB, down ... ; fp32: ..." lines.
void print_transfer(const spes::Config& cfg) {
  if (cfg.spes_config.mode == spes::SyncMode::Centralized) return;
  const int64_t me = cfg.spes_config.peer_id;
  const spes::report::TransferFormula f = spes::report::transfer_formula(cfg, me);
  spes::report::TransferFormula fp32 = f;
  fp32.compression = spes::Compression::None;
  fp32.value_bytes = 4;
  const int64_t up = f.upload_bytes(), down = f.download_bytes(), merge = f.download_merge_bytes();
  const int64_t ref = fp32.upload_bytes() + fp32.download_bytes();
  fmt::print("sync per round, node {} (compression {}; report/transfer_formula.h): up {}, down "
             "{} ({} in a merge round); {:.4f}x fp32's {}\n", me,
             cfg.spes_config.transfer.compression, spes::human_bytes(up),
             spes::human_bytes(down), spes::human_bytes(merge),
             static_cast<double>(up + down) / static_cast<double>(ref),
             spes::human_bytes(ref));
  for (double mbit : {100.0, 20.0})
    fmt::print("  at {:.0f} Mbit/s: {:.1f} s up + {:.1f} s down = {:.1f} s per round (fp32: "
               "{:.1f} s)\n", mbit, transfer_s(up, mbit), transfer_s(down, mbit),
               transfer_s(up + down, mbit), transfer_s(ref, mbit));
}

void print_text(const spes::Config& cfg, const std::vector<ParamCounts>& nodes,
                const std::vector<NodeMemory>& mems, const std::vector<std::string>& ignored) {
  const auto& m = cfg.model;
  const auto& s = cfg.spes_config;
  const int64_t me = s.peer_id;
  fmt::print("# resolved config (this project's keys)\n{}\n", spes::config_to_yaml(cfg));
  if (!ignored.empty())
    fmt::print("# ignored operational reference keys: {}\n\n", fmt::join(ignored, ", "));
  fmt::print("model: {} layers, d_model {}, {} heads ({} key/value), ", m.n_layers, m.d_model,
             m.n_heads, m.kv_heads());
  if (m.is_moe())
    fmt::print("{} experts top-{} ({} weights), expert hidden size F {}", m.moe_num_experts,
               m.moe_top_k, m.moe_norm_topk_prob ? "normalised" : "raw", m.ffn_hidden_size());
  else
    fmt::print("dense MLP of hidden size F {}", m.ffn_hidden_size());
  fmt::print(", QK-norm {}, vocabulary {} ({} embedding rows)\n", m.qk_norm, m.vocab_size,
             m.embedding_rows());
  const ParamCounts& c = nodes.at(me);
  fmt::print("parameters: total {}, active per token {}\n", count(c.total),
             count(c.active_per_token));
  fmt::print("  shared {}, experts {}\n", count(c.shared), count(c.experts));
  const spes::Ownership own = spes::Ownership::from_config(cfg);
  fmt::print("trainable per node (spes_config.mode {}):\n", s.mode);
  for (size_t i = 0; i < nodes.size(); ++i)
    fmt::print("  node {}{}: {}; owns {}\n", i,
               static_cast<int64_t>(i) == me ? " (this config)" : "", count(nodes[i].trainable),
               owned_experts(own, static_cast<int64_t>(i)));
  fmt::print("memory per node (micro-batch {} x {} tokens, precision {}, AdamW moments {}; "
             "activations are an estimate, model/memory_estimate.h):\n",
             cfg.device_train_microbatch_size, m.max_sequence_length, cfg.precision,
             cfg.optimizer.moment_dtype);
  std::string head = fmt::format("  {:>5}", "node");
  for (const auto& [dtype, bytes] : mems.at(0).weights_by_dtype)
    head += fmt::format("  {:>12}", "weights " + dtype);
  fmt::print("{}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}\n", head, "gradients", "AdamW",
             "activations", "sync state", "total");
  for (size_t i = 0; i < mems.size(); ++i) {
    std::string row = fmt::format("  {:>5}", i);
    for (const auto& [dtype, bytes] : mems[i].weights_by_dtype)
      row += fmt::format("  {:>12}", spes::human_bytes(bytes));
    fmt::print("{}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}\n", row,
               spes::human_bytes(mems[i].gradients), spes::human_bytes(mems[i].adam_moments),
               spes::human_bytes(mems[i].activations), spes::human_bytes(mems[i].sync_state),
               spes::human_bytes(mems[i].total()));
  }
  print_transfer(cfg);
}

nlohmann::json transfer_json(const spes::Config& cfg) {
  const spes::report::TransferFormula f =
      spes::report::transfer_formula(cfg, cfg.spes_config.peer_id);
  return {{"compression", cfg.spes_config.transfer.compression.name()},
          {"upload_bytes", f.upload_bytes()},
          {"download_bytes", f.download_bytes()},
          {"download_merge_bytes", f.download_merge_bytes()},
          {"round_s_at_100mbit", transfer_s(f.upload_bytes() + f.download_bytes(), 100.0)}};
}

nlohmann::json to_json(const spes::Config& cfg, const std::vector<ParamCounts>& nodes,
                       const std::vector<NodeMemory>& mems,
                       const std::vector<std::string>& ignored) {
  const int64_t me = cfg.spes_config.peer_id;
  const ParamCounts& c = nodes.at(me);
  const NodeMemory& mem = mems.at(me);
  nlohmann::json by_node = nlohmann::json::array();
  for (const auto& n : nodes) by_node.push_back(n.trainable);
  nlohmann::json weights = nlohmann::json::object();
  for (const auto& [dtype, bytes] : mem.weights_by_dtype) weights[dtype] = bytes;
  return {{"node", me},
          {"mode", cfg.spes_config.mode.name()},
          {"parameters",
           {{"total", c.total},
            {"active_per_token", c.active_per_token},
            {"trainable_per_node", c.trainable},
            {"trainable_by_node", by_node},
            {"shared", c.shared},
            {"experts", c.experts},
            {"own_experts", c.own_experts}}},
          {"memory",
           {{"node", me},
            {"micro_batch", cfg.device_train_microbatch_size},
            {"sequence", cfg.model.max_sequence_length},
            {"precision", cfg.precision.name()},
            {"weights_by_dtype", weights},
            {"weights", mem.weights()},
            {"gradients", mem.gradients},
            {"adam_moments", mem.adam_moments},
            {"activations", mem.activations},
            {"sync_state", mem.sync_state},
            {"total", mem.total()}}},
          {"transfer", transfer_json(cfg)},
          {"ignored_keys", ignored},
          {"config_yaml", spes::config_to_yaml(cfg)}};
}

void run_config(const ConfigArgs& a) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("config"));  // stdout holds only the report
  std::vector<std::string> ignored;
  const spes::Config cfg = spes::config_load(a.config, a.sets, &ignored);
  std::vector<ParamCounts> nodes;
  std::vector<NodeMemory> mems;
  for (int64_t i = 0; i < cfg.spes_config.num_peers; ++i) {
    nodes.push_back(spes::param_counts(cfg, i));
    mems.push_back(spes::node_memory(cfg, nodes.back()));
  }
  if (a.json)
    fmt::print("{}\n", to_json(cfg, nodes, mems, ignored).dump(2));
  else
    print_text(cfg, nodes, mems, ignored);
}

spes::cli::SubcommandRegistrar register_config(
    "config", "Print a config resolved (reference OLMo/SPES YAMLs too) with its parameter and "
    "memory counts", [](CLI::App& sub) {
      auto a = std::make_shared<ConfigArgs>();
      sub.add_option("--config", a->config,
                     "YAML config, this project's or the reference's (default: the built-in "
                     "configs/default.yaml)");
      spes::cli::add_set_option(sub, a->sets);
      sub.add_flag("--json", a->json,
                   "Print one JSON object (parameters.total, active_per_token, "
                   "trainable_per_node; memory) instead of text");
      sub.callback([a] { run_config(*a); });
    }, spes::cli::GpuUse::Never);

}  // namespace
