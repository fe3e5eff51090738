// Parameter registry (see registry.h).
#include "spes/model/registry.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"

namespace spes {

std::vector<std::vector<bool>> frozen_expert_table(const Config& cfg) {
  const int64_t L = cfg.model.n_layers, E = cfg.model.is_moe() ? cfg.model.moe_num_experts : 0;
  std::vector<std::vector<bool>> frozen(L, std::vector<bool>(E, false));
  for (const auto& spec : cfg.frozen_experts) {
    auto parts = split(spec, ':');
    SPES_CHECK(parts.size() == 2, "frozen_experts: '{}' must be 'layer:expert' ('*' for all)",
               spec);
    auto parse = [&](const std::string& s, int64_t limit, const char* what) -> int64_t {
      if (s == "*") return -1;
      try {
        size_t pos = 0;
        int64_t v = std::stoll(s, &pos);
        if (pos == s.size() && v >= 0 && v < limit) return v;
      } catch (const std::exception&) {
      }
      fail("frozen_experts: '{}' has {} '{}', expected '*' or an integer in [0, {})", spec, what,
           s, limit);
    };
    int64_t l = parse(parts[0], L, "layer"), e = parse(parts[1], E, "expert");
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < E; ++j)
        if ((l < 0 || l == i) && (e < 0 || e == j)) frozen[i][j] = true;
  }
  return frozen;
}

std::vector<std::vector<bool>> trainable_expert_table(const Config& cfg,
                                                      const Ownership& ownership,
                                                      int64_t node_id) {
  auto table = frozen_expert_table(cfg);
  const bool own_only = cfg.spes_config.mode == SyncMode::Spes;
  for (size_t l = 0; l < table.size(); ++l)
    for (size_t e = 0; e < table[l].size(); ++e)
      table[l][e] = (!own_only || ownership.owner(l, e) == node_id) && !table[l][e];
  return table;
}

ParamRegistry::ParamRegistry(const Transformer& model, const Config& cfg,
                             const Ownership& ownership, int64_t node_id)
    : node_id_(node_id) {
  const auto trainable = trainable_expert_table(cfg, ownership, node_id);
  for (const auto& p : model.params()) {
    RegistryEntry e;
    e.name = p.name;
    e.tensor = p.tensor;
    e.role = p.role;
    e.layer = p.layer;
    e.expert = p.expert;
    if (p.role == ParamRole::Expert) {
      e.owner = ownership.owner(p.layer, p.expert);
      e.trainable = trainable[p.layer][p.expert];
    } else {
      e.trainable = true;
    }
    // A tensor stored in a low-precision dtype has no fp32 master: it cannot be trained.
    SPES_CHECK(!e.trainable || e.tensor.scalar_type() == torch::kFloat32 ||
                   e.tensor.scalar_type() == torch::kFloat64,
               "internal: '{}' is trainable on node {} but stored as {} (the model's layout was "
               "made for another node or config)", e.name, node_id,
               c10::toString(e.tensor.scalar_type()));
    e.tensor.set_requires_grad(e.trainable);
    index_[e.name] = entries_.size();
    entries_.push_back(std::move(e));
  }
}

ParamRegistry ParamRegistry::cpu_copy() const {
  ParamRegistry c;
  c.node_id_ = node_id_;
  c.index_ = index_;
  c.entries_ = entries_;
  for (auto& e : c.entries_) {
    const torch::Tensor t = e.tensor.detach();
    e.tensor = t.is_cpu() ? t.clone() : t.to(torch::kCPU);
  }
  return c;
}

std::vector<RegistryEntry> ParamRegistry::trainable() const {
  std::vector<RegistryEntry> out;
  for (const auto& e : entries_)
    if (e.trainable) out.push_back(e);
  return out;
}

const RegistryEntry* ParamRegistry::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

int64_t ParamRegistry::trainable_numel() const {
  int64_t n = 0;
  for (const auto& e : entries_)
    if (e.trainable) n += e.tensor.numel();
  return n;
}

int64_t ParamRegistry::frozen_numel() const {
  int64_t n = 0;
  for (const auto& e : entries_)
    if (!e.trainable) n += e.tensor.numel();
  return n;
}

std::string ParamRegistry::fingerprint() const {
  std::string s;
  // Floating tensors count as "Float" whatever their storage: a node keeping frozen experts in
  // bf16 holds the same model as the server's fp32 one.
  for (const auto& e : entries_)
    s += fmt::format("{}:{}:{}:{};", e.name, fmt::join(e.tensor.sizes(), "x"),
                     e.role == ParamRole::Expert ? "expert" : "shared",
                     e.tensor.is_floating_point() ? "Float"
                                                  : c10::toString(e.tensor.scalar_type()));
  return sha256_hex(s).substr(0, 16);
}

std::string ParamRegistry::weights_sha256() const {
  // Each tensor's digest on its own, on several threads where the weights are in host memory
  // (one SHA-256 runs at about 1.8 GB/s; a device tensor is copied to the host one at a time),
  // then one digest over the names and those digests: the same value on any thread count.
  std::vector<std::string> part(entries_.size());
  auto digest = [&](size_t i) {
    const torch::Tensor t =
        entries_[i].tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    part[i] = sha256_hex(t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  };
  bool on_host = true;
  for (const auto& e : entries_) on_host = on_host && e.tensor.device().is_cpu();
  if (on_host) {
    at::parallel_for(0, static_cast<int64_t>(entries_.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) digest(static_cast<size_t>(i));
    });
  } else {
    for (size_t i = 0; i < entries_.size(); ++i) digest(i);
  }
  Sha256 h;
  for (size_t i = 0; i < entries_.size(); ++i) {
    h.update(entries_[i].name.data(), entries_[i].name.size());
    h.update(part[i].data(), part[i].size());
  }
  return h.hex_digest();
}

std::string ParamRegistry::flat_weights_sha256() const {
  Sha256 h;
  for (const auto& e : entries_) {
    h.update(e.name.data(), e.name.size());
    torch::Tensor t = e.tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    h.update(t.data_ptr(), t.numel() * sizeof(float));
  }
  return h.hex_digest();
}

}  // namespace spes
