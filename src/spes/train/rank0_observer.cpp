// Rank 0 runs the node's observer, the other ranks receive what it changed (rank0_observer.h).
#include "spes/train/rank0_observer.h"

namespace spes {

Rank0Observer::Rank0Observer(DistGroup& group, StepObserver* inner)
    : group_(group), inner_(group.rank() == 0 ? inner : nullptr) {}

namespace {
// Rank 0's observer runs alone: a map change it makes changes rank 0 only, until share().
template <class F>
auto alone(Trainer& t, F&& f) {
  struct Alone {
    Trainer& t;
    explicit Alone(Trainer& tr) : t(tr) { t.set_rank0_alone(true); }
    ~Alone() { t.set_rank0_alone(false); }
  } scope(t);
  return f();
}
}  // namespace

std::vector<uint32_t> Rank0Observer::versions(const Trainer& t) const {
  std::vector<uint32_t> v;
  for (const auto& e : t.registry().entries()) v.push_back(e.tensor._version());
  return v;
}

void Rank0Observer::share(Trainer& t, const std::vector<uint32_t>& before,
                          const TrainState& sb) {
  TrainState& s = t.state();
  const bool remapped = group_.rank() == 0 && t.rank0_changed_ownership();
  const bool changed = group_.rank() == 0 &&
                       (versions(t) != before || s.step != sb.step || s.tokens != sb.tokens ||
                        s.sync_round != sb.sync_round || s.loader.epoch != sb.loader.epoch ||
                        s.loader.position != sb.loader.position ||
                        s.ownership_epoch != sb.ownership_epoch || remapped);
  torch::Tensor head = torch::tensor({changed ? int64_t{1} : int64_t{0}, s.step, s.tokens,
                                      s.sync_round, s.loader.epoch, s.loader.position,
                                      s.ownership_epoch, remapped ? int64_t{1} : int64_t{0}},
                                     torch::kInt64)
                           .to(group_.device());
  group_.broadcast(head);
  head = head.to(torch::kCPU);
  if (head[0].item<int64_t>() == 0) return;
  if (group_.rank() != 0) {
    s.step = head[1].item<int64_t>();
    s.tokens = head[2].item<int64_t>();
    s.sync_round = head[3].item<int64_t>();
    s.loader.epoch = head[4].item<int64_t>();
    s.loader.position = head[5].item<int64_t>();
    s.ownership_epoch = head[6].item<int64_t>();
    t.train_loader().restore(s.loader);
  }
  // The new trainable set first: it decides the layout the weights below are broadcast in.
  if (head[7].item<int64_t>() != 0) t.follow_rank0_ownership();
  std::vector<torch::Tensor> all;
  for (const auto& e : t.registry().entries()) all.push_back(e.tensor);
  broadcast_from_rank0(group_, all);
}

void Rank0Observer::on_start(Trainer& t) {
  const auto before = versions(t);
  const TrainState sb = t.state();
  if (inner_) alone(t, [&] { inner_->on_start(t); });
  share(t, before, sb);
}

nlohmann::json Rank0Observer::after_step(Trainer& t, int64_t step) {
  const auto before = versions(t);
  const TrainState sb = t.state();
  nlohmann::json extra;
  if (inner_) extra = alone(t, [&] { return inner_->after_step(t, step); });
  share(t, before, sb);
  return extra;
}

void Rank0Observer::on_finish(Trainer& t) {
  if (inner_) inner_->on_finish(t);
}

nlohmann::json Rank0Observer::unreported(Trainer& t) {
  return inner_ ? inner_->unreported(t) : nlohmann::json();
}

void Rank0Observer::on_stop(Trainer& t) {
  if (inner_) inner_->on_stop(t);
}

void Rank0Observer::save_state(TrainState& s) {
  if (inner_) inner_->save_state(s);
}

}  // namespace spes
