// A node's sync round running while it trains (see round_in_flight.h).
#include "spes/sync/node/round_in_flight.h"

#include "spes/common/error.h"

namespace spes::sync {

RoundInFlight::RoundInFlight(const ParamRegistry& live, int64_t round, int64_t step,
                             int64_t deadline, Exchange exchange)
    : round_(round), step_(step), deadline_(deadline), copy_(live.cpu_copy()) {
  for (const auto& e : live.entries())
    if (e.trainable) uploaded_.push_back(e.tensor.detach().clone());
  result_ = std::async(std::launch::async,
                       [this, exchange = std::move(exchange)] { return exchange(copy_); });
}

RoundInFlight::~RoundInFlight() {
  if (result_.valid()) result_.wait();
}

bool RoundInFlight::ready() const {
  return result_.valid() &&
         result_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

RoundExchange RoundInFlight::wait() {
  SPES_CHECK(result_.valid(), "internal: round {} was already collected", round_);
  RoundExchange x = result_.get();
  published_ = !x.needs_catch_up();
  return x;
}

void RoundInFlight::apply(const ParamRegistry& live) const {
  SPES_CHECK(published_, "internal: round {} is applied without a published model", round_);
  const auto& entries = live.entries();
  SPES_CHECK(entries.size() == copy_.entries().size(), "internal: the registry changed shape "
             "while round {} was in flight", round_);
  torch::NoGradGuard no_grad;
  size_t k = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const torch::Tensor w = entries[i].tensor.detach();
    const torch::Tensor published = copy_.entries()[i].tensor.to(w.device(), w.scalar_type());
    if (!entries[i].trainable) {
      w.copy_(published);
      continue;
    }
    // P + (live - S): exactly P when the node has not trained since the upload.
    const torch::Tensor progress = w - uploaded_[k++];
    w.copy_(published + progress);
  }
}

uint64_t RoundInFlight::bytes() const {
  uint64_t n = 0;
  for (const auto& e : copy_.entries()) n += e.tensor.numel() * e.tensor.element_size();
  for (const auto& t : uploaded_) n += t.numel() * t.element_size();
  return n;
}

}  // namespace spes::sync
