// Parameter registry (see registry.h).
#include "spes/model/registry.h"

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

ParamRegistry::ParamRegistry(const Transformer& model, const Config& cfg,
                             const Ownership& ownership, int64_t node_id)
    : node_id_(node_id) {
  const auto frozen = frozen_expert_table(cfg);
  const bool own_only = cfg.spes_config.mode == "spes";
  for (const auto& p : model.params()) {
    RegistryEntry e;
    e.name = p.name;
    e.tensor = p.tensor;
    e.role = p.role;
    e.layer = p.layer;
    e.expert = p.expert;
    if (p.role == ParamRole::Expert) {
      e.owner = ownership.owner(p.layer, p.expert);
      e.trainable = (!own_only || e.owner == node_id) && !frozen[p.layer][p.expert];
    } else {
      e.trainable = true;
    }
    e.tensor.set_requires_grad(e.trainable);
    index_[e.name] = entries_.size();
    entries_.push_back(std::move(e));
  }
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
  for (const auto& e : entries_)
    s += fmt::format("{}:{}:{}:{};", e.name, fmt::join(e.tensor.sizes(), "x"),
                     e.role == ParamRole::Expert ? "expert" : "shared",
                     c10::toString(e.tensor.scalar_type()));
  return sha256_hex(s).substr(0, 16);
}

std::string ParamRegistry::weights_sha256() const {
  Sha256 h;
  for (const auto& e : entries_) {
    h.update(e.name.data(), e.name.size());
    torch::Tensor t = e.tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    h.update(t.data_ptr(), t.numel() * sizeof(float));
  }
  return h.hex_digest();
}

}  // namespace spes
