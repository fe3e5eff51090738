// Stacked expert storage for grouped GEMMs (see expert_stack.h).
#include "spes/model/expert_stack.h"

#include <algorithm>

#include "spes/common/error.h"
#include "spes/model/transformer.h"

namespace spes {

ExpertStack expert_stack_create(std::vector<ExpertWeights>& experts,
                                const std::vector<bool>& trainable, int64_t d_model,
                                int64_t hidden, torch::ScalarType compute_dtype,
                                torch::ScalarType frozen_dtype, torch::Device device) {
  const int64_t E = static_cast<int64_t>(experts.size()), D = d_model, F = hidden;
  SPES_CHECK(static_cast<int64_t>(trainable.size()) == E,
             "internal: expert stack of {} experts got {} trainable flags", E, trainable.size());
  ExpertStack s;
  auto opts = torch::TensorOptions().dtype(compute_dtype).device(device);
  s.w13 = torch::zeros({E, 2 * F, D}, opts);
  s.w2 = torch::zeros({E, D, F}, opts);
  for (int64_t pass = 0; pass < 2; ++pass)  // trainable experts first, then the frozen ones
    for (int64_t e = 0; e < E; ++e)
      if (trainable[e] == (pass == 0)) s.expert_of_slot.push_back(e);
  s.n_trainable = std::count(trainable.begin(), trainable.end(), true);
  std::vector<int64_t> slot_of(E);
  for (int64_t slot = 0; slot < E; ++slot) slot_of[s.expert_of_slot[slot]] = slot;
  s.slot_of_expert = torch::tensor(slot_of, torch::kInt64).to(device);
  s.owned.assign(E, false);
  auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  for (int64_t slot = 0; slot < E; ++slot) {
    const int64_t e = s.expert_of_slot[slot];
    const torch::ScalarType storage = trainable[e] ? torch::kFloat32 : frozen_dtype;
    ExpertWeights& x = experts[e];
    if (storage == compute_dtype) {
      x.w1 = s.w13[slot].narrow(0, 0, F);
      x.v1 = s.w13[slot].narrow(0, F, F);
      x.w2 = s.w2[slot];
    } else {
      SPES_CHECK(storage == torch::kFloat32, "internal: experts of their own are fp32");
      s.owned[slot] = true;
      x.w1 = torch::zeros({F, D}, fp32);
      x.v1 = torch::zeros({F, D}, fp32);
      x.w2 = torch::zeros({D, F}, fp32);
    }
  }
  s.sync = std::make_shared<ExpertStack::Sync>();
  s.sync->versions.assign(3 * E, ExpertStack::kNever);
  return s;
}

void expert_stack_refresh(const ExpertStack& s, const std::vector<ExpertWeights>& experts) {
  std::lock_guard<std::mutex> lk(s.sync->mu);
  torch::NoGradGuard ng;
  const int64_t E = static_cast<int64_t>(s.expert_of_slot.size());
  const int64_t F = s.w2.size(2);
  for (int64_t slot = 0; slot < E; ++slot) {
    if (!s.owned[slot]) continue;
    const ExpertWeights& x = experts[s.expert_of_slot[slot]];
    const torch::Tensor* src[3] = {&x.w1, &x.v1, &x.w2};
    torch::Tensor dst[3] = {s.w13[slot].narrow(0, 0, F), s.w13[slot].narrow(0, F, F), s.w2[slot]};
    for (int i = 0; i < 3; ++i) {
      uint32_t& seen = s.sync->versions[3 * slot + i];
      const uint32_t now = src[i]->_version();
      if (seen == now) continue;
      dst[i].copy_(*src[i]);
      seen = now;
    }
  }
}

}  // namespace spes
