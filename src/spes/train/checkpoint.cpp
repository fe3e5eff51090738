// Checkpoint directories (see checkpoint.h).
#include "spes/train/checkpoint.h"

#include <fmt/ranges.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <filesystem>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/data/tokenizer_path.h"
#include "spes/io/files.h"
#include "spes/io/format_version.h"
#include "spes/io/run_layout.h"
#include "spes/io/safetensors.h"

namespace spes {
namespace fs = std::filesystem;

NamedTensors registry_tensors(const ParamRegistry& registry) {
  NamedTensors out;
  for (const auto& e : registry.entries()) out.emplace_back(e.name, e.tensor.detach());
  return out;
}

void registry_load_tensors(const ParamRegistry& registry, const NamedTensors& tensors,
                           bool require_all, const std::string& origin) {
  std::unordered_map<std::string, const torch::Tensor*> by_name;
  for (const auto& [n, t] : tensors) {
    const RegistryEntry* e = registry.find(n);
    SPES_CHECK(e, "{}: tensor '{}' is not part of this model (different architecture?)", origin,
               n);
    SPES_CHECK(t.sizes() == e->tensor.sizes(), "{}: tensor '{}' has shape [{}], the model "
               "expects [{}]", origin, n, fmt::join(t.sizes(), ", "),
               fmt::join(e->tensor.sizes(), ", "));
    SPES_CHECK(t.is_floating_point(), "{}: tensor '{}' is not floating point", origin, n);
    SPES_CHECK(torch::isfinite(t).all().item<bool>(), "{}: tensor '{}' holds NaN or Inf values",
               origin, n);
    by_name[n] = &t;
  }
  if (require_all)
    for (const auto& e : registry.entries())
      SPES_CHECK(by_name.count(e.name), "{}: tensor '{}' is missing", origin, e.name);
  torch::NoGradGuard ng;
  for (const auto& [n, t] : by_name) registry.find(n)->tensor.copy_(*t);
}

void checkpoint_tidy(const std::string& dir) {
  if (dir_commit_recover(dir))
    spdlog::warn("{}: the previous checkpoint was being replaced when its process ended; "
                 "took back the complete one it replaced ({}.old)", dir, dir);
  const fs::path d(dir);
  const fs::path parent = d.has_parent_path() ? d.parent_path() : fs::path(".");
  if (!fs::is_directory(parent)) return;
  const std::string prefix = d.filename().string() + ".tmp.";
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stoll(pid_text));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // still written
    std::error_code ec;
    fs::remove_all(e.path(), ec);
    spdlog::info("removed {}: a partial checkpoint of process {}, which ended while writing it",
                 e.path().string(), pid);
  }
}

void checkpoint_save(const std::string& dir, const Config& cfg, const ParamRegistry& registry,
                     const AdamW* optimizer, const TrainState& state,
                     const std::string& tokenizer_file) {
  const fs::path dst(dir);
  if (dst.has_parent_path()) fs::create_directories(dst.parent_path());
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  nlohmann::json files;
  auto write = [&](const std::string& name, const std::string& bytes) {
    file_write_atomic(tmp + "/" + name, bytes);
    files[name] = {{"bytes", bytes.size()}, {"sha256", sha256_hex(bytes)}};
  };
  const std::string format = format_name(kCheckpointFormat, kCheckpointFormatVersion);
  write("model.safetensors",
        safetensors_serialize(registry_tensors(registry), {{"format", format}}));
  if (optimizer) write("optimizer.safetensors", safetensors_serialize(optimizer->state_tensors()));
  write("config.yaml", config_to_yaml(cfg));
  // Keep the tokenizer with the weights so evaluation and export need nothing else.
  const std::string tok =
      tokenizer_file.empty() ? resolve_tokenizer_path(cfg.data) : tokenizer_file;
  if (!tok.empty())
    write(ends_with(tok, ".json") ? "tokenizer.json" : "tokenizer.model", file_read(tok));
  nlohmann::json st = {{"format", format},
                       {"step", state.step},
                       {"tokens", state.tokens},
                       {"loader", {{"epoch", state.loader.epoch},
                                   {"position", state.loader.position}}},
                       {"sync_round", state.sync_round},
                       {"optimizer_step", optimizer ? optimizer->step_count() : 0},
                       {"model_fingerprint", registry.fingerprint()},
                       {"extra", state.extra},
                       {"files", files}};
  if (state.ownership)
    st["ownership"] = {{"epoch", state.ownership_epoch},
                       {"num_nodes", state.ownership->num_nodes()},
                       {"table", state.ownership->table()}};
  file_write_atomic(run_layout::checkpoint_state(tmp), st.dump(2));
  dir_fsync(tmp);
  dir_commit(tmp, dir);
}

static nlohmann::json read_state(const std::string& dir) {
  const std::string path = run_layout::checkpoint_state(dir);
  SPES_CHECK(fs::exists(path), "'{}' is not a checkpoint directory (no state.json)", dir);
  nlohmann::json st;
  try {
    st = nlohmann::json::parse(file_read(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: state.json is corrupt ({})", dir, e.what());
  }
  SPES_CHECK(st.is_object() && st.contains("format") && st["format"].is_string(), "{}: "
             "state.json names no format; it is not a spes checkpoint", dir);
  format_version(st["format"].get<std::string>(), kCheckpointFormat, kCheckpointFormatVersion,
                 path);
  return st;
}

static std::string read_verified(const std::string& dir, const nlohmann::json& st,
                                 const std::string& name) {
  const std::string bytes = file_read(dir + "/" + name);
  const auto& f = st.at("files").at(name);
  SPES_CHECK(bytes.size() == f.at("bytes").get<size_t>(),
             "{}/{}: size {} differs from the {} bytes recorded in state.json (truncated?)", dir,
             name, bytes.size(), f.at("bytes").get<size_t>());
  SPES_CHECK(sha256_hex(bytes) == f.at("sha256").get<std::string>(),
             "{}/{}: checksum mismatch (the file is corrupt)", dir, name);
  return bytes;
}

// The "ownership" object of a state.json, if any: epoch and checked map.
static std::optional<std::pair<int64_t, Ownership>> parse_ownership(const nlohmann::json& st,
                                                                    const std::string& dir) {
  if (!st.contains("ownership")) return std::nullopt;
  const std::string origin = dir + "/state.json: ownership";
  try {
    const auto& o = st.at("ownership");
    const int64_t epoch = o.at("epoch").get<int64_t>();
    SPES_CHECK(epoch >= 0, "{}: epoch {} is negative", origin, epoch);
    return std::make_pair(
        epoch, Ownership::from_table(o.at("num_nodes").get<int64_t>(),
                                     o.at("table").get<std::vector<std::vector<int64_t>>>(),
                                     origin));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: lacks a field or has a wrong type ({})", origin, e.what());
  }
}

// Throws unless the map fits the registry's model (its MoE layers x experts).
static void check_ownership_fits(const Ownership& o, const ParamRegistry& registry,
                                 const std::string& dir) {
  int64_t layers = 0, experts = 0;
  for (const auto& e : registry.entries())
    if (e.role == ParamRole::Expert) {
      layers = std::max(layers, e.layer + 1);
      experts = std::max(experts, e.expert + 1);
    }
  const std::string origin = dir + "/state.json: ownership";
  if (experts == 0) {
    SPES_CHECK(o.num_experts() == 0, "{}: the map gives owners to {} experts per layer but the "
               "model has no experts (a checkpoint of another model)", origin, o.num_experts());
    return;
  }
  o.check_shape(layers, experts, origin);
}

std::optional<std::pair<int64_t, Ownership>> checkpoint_ownership(const std::string& dir,
                                                                  int64_t layers,
                                                                  int64_t experts) {
  auto o = parse_ownership(read_state(dir), dir);
  if (o && layers >= 0) o->second.check_shape(layers, experts, dir + "/state.json: ownership");
  return o;
}

Config checkpoint_config(const std::string& dir) {
  const auto st = read_state(dir);
  return config_parse(read_verified(dir, st, "config.yaml"), {}, dir + "/config.yaml");
}

TrainState checkpoint_load(const std::string& dir, const ParamRegistry& registry,
                           AdamW* optimizer) {
  const auto st = read_state(dir);
  TrainState s;
  try {
    const std::string model_path = dir + "/model.safetensors";
    NamedTensors weights = safetensors_parse(read_verified(dir, st, "model.safetensors"), nullptr,
                                             model_path);
    NamedTensors opt_state;
    const std::string opt_path = dir + "/optimizer.safetensors";
    if (optimizer) {
      SPES_CHECK(st.at("files").contains("optimizer.safetensors"),
                 "{}: checkpoint has no optimizer state (weights only); cannot resume training",
                 dir);
      opt_state = safetensors_parse(read_verified(dir, st, "optimizer.safetensors"), nullptr,
                                    opt_path);
    }
    const int64_t opt_step = optimizer ? st.at("optimizer_step").get<int64_t>() : 0;
    auto ownership = parse_ownership(st, dir);
    if (ownership) check_ownership_fits(ownership->second, registry, dir);
    if (ownership && optimizer)  // the moments are those of the map's trainable set
      for (const auto& e : registry.entries())
        SPES_CHECK(e.role != ParamRole::Expert ||
                       e.owner == ownership->second.owner(e.layer, e.expert),
                   "{}: the checkpoint was trained with ownership map epoch {} (expert {} of "
                   "layer {} owned by node {}), but this model was built for another map (owner "
                   "{}); build it with the checkpoint's map (checkpoint_ownership)", dir,
                   ownership->first, e.expert, e.layer,
                   ownership->second.owner(e.layer, e.expert), e.owner);
    (void)st.at("step"); (void)st.at("tokens"); (void)st.at("loader").at("epoch");
    (void)st.at("loader").at("position");
    if (optimizer) optimizer->check_state(opt_state, opt_path);  // all checks before any copy
    registry_load_tensors(registry, weights, /*require_all=*/true, model_path);
    if (optimizer) optimizer->load_state(opt_state, opt_step, opt_path);
    s.step = st.at("step").get<int64_t>();
    s.tokens = st.at("tokens").get<int64_t>();
    s.loader.epoch = st.at("loader").at("epoch").get<int64_t>();
    s.loader.position = st.at("loader").at("position").get<int64_t>();
    s.sync_round = st.value("sync_round", int64_t{0});
    s.extra = st.value("extra", nlohmann::json());
    if (ownership) {
      s.ownership_epoch = ownership->first;
      s.ownership = std::move(ownership->second);
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: state.json lacks a field or has a wrong type ({})", dir, e.what());
  }
  return s;
}

}  // namespace spes
