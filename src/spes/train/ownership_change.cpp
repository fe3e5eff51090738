// Changing a node's trainable experts in the running process (see ownership_change.h).
#include "spes/train/ownership_change.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <array>
#include <map>

#include "spes/common/error.h"
#include "spes/train/trainer.h"

namespace spes {
namespace {

const std::array<const char*, 3> kExpertProjs = {"gate_proj", "up_proj", "down_proj"};

int64_t moe_experts(const Config& cfg) {
  return cfg.model.is_moe() ? cfg.model.moe_num_experts : 0;
}

}  // namespace

int64_t rewarmup_steps_for(const Config& cfg) {
  const int64_t n = cfg.spes_config.rewarmup_steps;
  return n >= 0 ? n : std::max<int64_t>(0, cfg.scheduler.t_warmup);
}

void check_handed_moments(const ExpertMoments& handed, const ParamRegistry& registry,
                          const std::vector<std::vector<bool>>& before,
                          const std::vector<std::vector<bool>>& after,
                          const std::string& origin) {
  for (const auto& [name, m] : handed.by_name) {
    const RegistryEntry* r = registry.find(name);
    SPES_CHECK(r && r->role == ParamRole::Expert, "{}: '{}' is not an expert tensor of this "
               "model", origin, name);
    const int64_t l = r->layer, e = r->expert;
    SPES_CHECK(after[l][e] && !before[l][e], "{}: '{}' belongs to expert {} of layer {}, which "
               "node {} {}; moments are handed only for the experts a node gains", origin, name,
               e, l, registry.node_id(),
               before[l][e] ? "already trains (it keeps its own moments)"
                            : "does not train under the new map");
    for (const char* proj : kExpertProjs) {
      const std::string other = expert_param_name(l, e, proj);
      SPES_CHECK(handed.by_name.count(other), "{}: moments of '{}' are handed but not those of "
                 "'{}': an expert's moments come whole (all three tensors) or not at all",
                 origin, name, other);
    }
    for (const auto* t : {&m.exp_avg, &m.exp_avg_sq}) {
      const char* which = t == &m.exp_avg ? "exp_avg" : "exp_avg_sq";
      SPES_CHECK(t->defined() && t->scalar_type() == torch::kFloat32, "{}: {} of '{}' must be "
                 "an fp32 tensor", origin, which, name);
      SPES_CHECK(t->sizes() == r->tensor.sizes(), "{}: {} of '{}' has shape [{}] but the tensor "
                 "has [{}]", origin, which, name, fmt::join(t->sizes(), ", "),
                 fmt::join(r->tensor.sizes(), ", "));
      SPES_CHECK(torch::isfinite(*t).all().item<bool>(), "{}: {} of '{}' holds NaN or Inf "
                 "values", origin, which, name);
    }
    SPES_CHECK((m.exp_avg_sq >= 0).all().item<bool>(), "{}: exp_avg_sq of '{}' has negative "
               "values (a second moment is a mean of squares)", origin, name);
    SPES_CHECK(m.step >= 0, "{}: the step count of '{}' is {}, negative", origin, name, m.step);
    SPES_CHECK(m.rewarm_from >= -1, "{}: the re-warm-up start of '{}' is {} (a step, or -1 for "
               "none)", origin, name, m.rewarm_from);
  }
}

void check_ranks_hold_map(DistGroup& group, const Ownership& next, const torch::Device& device) {
  const std::string fp = next.fingerprint();
  const torch::Tensor mine =
      torch::from_blob(const_cast<char*>(fp.data()), {static_cast<int64_t>(fp.size())},
                       torch::kUInt8)
          .clone();
  torch::Tensor rank0 = mine.to(device, /*non_blocking=*/false, /*copy=*/true);
  group.broadcast(rank0);
  const bool same = torch::equal(rank0.to(torch::kCPU), mine);
  torch::Tensor differ = torch::tensor({same ? 0.0 : 1.0}, torch::kFloat64).to(device);
  group.all_reduce_sum({differ});
  SPES_CHECK(differ.to(torch::kCPU).item<double>() == 0, "change_ownership: the ranks of this "
             "node were given different ownership maps (rank {} holds {}; {} of {} ranks differ "
             "from rank 0); every rank must apply the same map", group.rank(), fp,
             differ.to(torch::kCPU).item<double>(), group.size());
}

ExpertMoments share_handed_moments(DistGroup& group, const ExpertMoments* handed,
                                   const std::vector<RegistryEntry>& gained,
                                   const torch::Device& device,
                                   const std::function<void(const ExpertMoments&)>& check) {
  const bool root = group.rank() == 0;
  std::string refused;
  if (root && handed) {
    try {
      check(*handed);
    } catch (const std::exception& e) {
      refused = e.what();
    }
  }
  // [refused, then per gained tensor: whether rank 0 hands its moments]
  const int64_t n = static_cast<int64_t>(gained.size());
  torch::Tensor flags = torch::zeros({1 + n}, torch::kFloat64);
  if (root) {
    flags[0] = refused.empty() ? 0.0 : 1.0;
    for (int64_t i = 0; i < n; ++i)
      flags[1 + i] = handed && handed->by_name.count(gained[i].name) ? 1.0 : 0.0;
  }
  flags = flags.to(device);
  group.broadcast(flags);
  flags = flags.to(torch::kCPU);
  if (flags[0].item<double>() > 0) {
    if (root) fail("{}", refused);
    fail("change_ownership: rank 0 refused the handed moments (its log says why)");
  }
  ExpertMoments out;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  for (int64_t i = 0; i < n; ++i) {
    if (flags[1 + i].item<double>() == 0) continue;
    const std::string& name = gained[i].name;
    const auto sizes = gained[i].tensor.sizes();
    torch::Tensor m, v, step;
    if (root) {
      const ExpertMoments::Entry& h = handed->by_name.at(name);
      m = h.exp_avg.contiguous().to(device, torch::kFloat32, false, /*copy=*/true);
      v = h.exp_avg_sq.contiguous().to(device, torch::kFloat32, false, /*copy=*/true);
      step = torch::tensor({h.step, h.rewarm_from}, torch::kInt64).to(device);
    } else {
      m = torch::empty(sizes, f32);
      v = torch::empty(sizes, f32);
      step = torch::zeros({2}, torch::kInt64).to(device);
    }
    for (const torch::Tensor& t : {m, v, step}) group.broadcast(t);
    const torch::Tensor s = step.to(torch::kCPU);
    out.by_name[name] = {m.to(torch::kCPU), v.to(torch::kCPU), s[0].item<int64_t>(),
                         s[1].item<int64_t>()};
  }
  return out;
}

std::vector<RegistryEntry> Trainer::gained_entries(
    const std::vector<std::vector<bool>>& before,
    const std::vector<std::vector<bool>>& after) const {
  std::vector<RegistryEntry> gained;
  for (const auto& e : registry_->entries())
    if (e.role == ParamRole::Expert && after[e.layer][e.expert] && !before[e.layer][e.expert])
      gained.push_back(e);
  return gained;
}

void Trainer::change_ownership(const Ownership& next, const ExpertMoments* handed) {
  // Every check first: a refused change leaves the trainer as it was. Ranks change together,
  // unless rank 0 changes alone (its sync client: follow_rank0_ownership() then brings the
  // other ranks along).
  next.check_shape(cfg_.model.n_layers, moe_experts(cfg_), "change_ownership: the new map");
  const bool together = opts_.dist && !rank0_alone_;
  if (together) check_ranks_hold_map(*opts_.dist, next, device_);
  const auto before = trainable_expert_table(cfg_, *ownership_, opts_.node_id);
  const auto after = trainable_expert_table(cfg_, next, opts_.node_id);
  auto check = [&](const ExpertMoments& h) {
    check_handed_moments(h, *registry_, before, after, "change_ownership: handed moments");
  };
  ExpertMoments shared;
  const ExpertMoments* given = handed;
  if (together) {
    shared = share_handed_moments(*opts_.dist, handed, gained_entries(before, after), device_,
                                  check);
    given = shared.by_name.empty() ? nullptr : &shared;
  } else if (given) {
    check(*given);
  }
  if (opts_.dist && !together) {  // rank 0 alone: kept for the other ranks
    if (!rank0_before_) rank0_before_ = std::make_unique<Ownership>(*ownership_);
    if (given)
      for (const auto& [name, m] : given->by_name) rank0_handed_.by_name[name] = m;
  }
  rebuild_for_ownership(next, before, after, given);
}

void Trainer::follow_rank0_ownership() {
  SPES_CHECK(opts_.dist, "internal: follow_rank0_ownership on a node without ranks");
  DistGroup& group = *opts_.dist;
  const bool root = group.rank() == 0;
  SPES_CHECK(!root || rank0_before_, "internal: follow_rank0_ownership without a change on rank 0");
  // Rank 0's map: its node count, then the owner of each expert, layer by layer.
  const int64_t layers = cfg_.model.n_layers, experts = moe_experts(cfg_);
  torch::Tensor flat = torch::zeros({1 + layers * experts}, torch::kInt64);
  if (root) {
    flat[0] = ownership_->num_nodes();
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t e = 0; e < experts; ++e) flat[1 + l * experts + e] = ownership_->owner(l, e);
  }
  flat = flat.to(device_);
  group.broadcast(flat);
  flat = flat.to(torch::kCPU);
  std::vector<std::vector<int64_t>> table(layers, std::vector<int64_t>(experts));
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t e = 0; e < experts; ++e) table[l][e] = flat[1 + l * experts + e].item<int64_t>();
  const Ownership next = Ownership::from_table(flat[0].item<int64_t>(), std::move(table),
                                               "rank 0's ownership map");
  // The experts gained over rank 0's whole change (from its map before the first one), with
  // the moments rank 0 was handed for them.
  const auto before =
      trainable_expert_table(cfg_, root ? *rank0_before_ : *ownership_, opts_.node_id);
  const auto after = trainable_expert_table(cfg_, next, opts_.node_id);
  const std::vector<RegistryEntry> gained = gained_entries(before, after);
  ExpertMoments handed;
  for (const auto& e : gained) {
    const auto it = rank0_handed_.by_name.find(e.name);
    if (root && it != rank0_handed_.by_name.end()) handed.by_name.insert(*it);
  }
  const ExpertMoments shared = share_handed_moments(
      group, handed.by_name.empty() ? nullptr : &handed, gained, device_,
      [](const ExpertMoments&) {});  // rank 0 checked them when it changed
  if (!root) rebuild_for_ownership(next, before, after, shared.by_name.empty() ? nullptr : &shared);
  rank0_before_.reset();
  rank0_handed_ = ExpertMoments();
  check_ranks_hold_map(group, *ownership_, device_);
}

void Trainer::rebuild_for_ownership(const Ownership& next,
                                    const std::vector<std::vector<bool>>& before,
                                    const std::vector<std::vector<bool>>& after,
                                    const ExpertMoments* given) {
  int64_t trained = 0, gained = 0, lost = 0;
  for (size_t l = 0; l < after.size(); ++l)
    for (size_t e = 0; e < after[l].size(); ++e) {
      trained += after[l][e];
      gained += after[l][e] && !before[l][e];
      lost += before[l][e] && !after[l][e];
    }
  // Then the parts, each rebuilt over the new trainable set: the layout (stacks, frozen
  // storage), the registry (requires_grad), AdamW (moments, gradient buffers), the micro-batch
  // replicas and the rank all-reduce's buckets.
  const int64_t workers = workers_->workers();
  workers_.reset();
  reducer_.reset();
  model_->set_trainable_experts(after);
  *ownership_ = next;
  *registry_ = ParamRegistry(*model_, cfg_, *ownership_, opts_.node_id);
  optimizer_->change_params(registry_->trainable(), given);
  workers_ = std::make_unique<MicroBatchWorkers>(*model_, registry_->trainable(), workers);
  if (opts_.dist)
    reducer_ = std::make_unique<GradientAllReduce>(*opts_.dist, *model_, *optimizer_);
  state_.ownership = *ownership_;
  memory_logged_ = false;  // the next step logs what the node holds now
  if (is_rank0())
    spdlog::info("{}now trains {} experts ({} gained, {} of them with handed moments; {} lost) "
                 "under ownership map {} at step {}", opts_.progress_prefix,
                 trained, gained,
                 given ? given->by_name.size() / kExpertProjs.size() : 0, lost,
                 ownership_->fingerprint(), state_.step);
}

ExpertMoments Trainer::expert_moments(
    const std::vector<std::pair<int64_t, int64_t>>& layer_expert) const {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < optimizer_->params().size(); ++i)
    index.emplace(optimizer_->params()[i].name, i);
  ExpertMoments out;
  for (const auto& [l, e] : layer_expert) {
    SPES_CHECK(l >= 0 && l < cfg_.model.n_layers && e >= 0 && e < moe_experts(cfg_),
               "expert_moments: there is no expert {} in layer {} (the model has {} x {})", e, l,
               cfg_.model.n_layers, moe_experts(cfg_));
    for (const char* proj : kExpertProjs) {
      const std::string name = expert_param_name(l, e, proj);
      auto it = index.find(name);
      SPES_CHECK(it != index.end(), "expert_moments: node {} does not train expert {} of layer "
                 "{} (owner: node {}), so it holds no moments of it", opts_.node_id, e, l,
                 ownership_->owner(l, e));
      out.by_name[name] = optimizer_->moments_of(it->second);
    }
  }
  return out;
}

}  // namespace spes
