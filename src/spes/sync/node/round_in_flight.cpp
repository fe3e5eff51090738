// A node's sync round running while it trains (see round_in_flight.h).
#include "spes/sync/node/round_in_flight.h"

#include "spes/common/error.h"

namespace spes::sync {

namespace {
// True when `buffer` can hold a copy of `t` on `device`: same shape and dtype.
bool fits(const torch::Tensor& buffer, const torch::Tensor& t, const torch::Device& device) {
  return buffer.defined() && buffer.sizes() == t.sizes() &&
         buffer.scalar_type() == t.scalar_type() && buffer.device() == device;
}

bool copy_fits(const ParamRegistry& copy, const ParamRegistry& live) {
  const auto& c = copy.entries();
  const auto& l = live.entries();
  if (c.size() != l.size()) return false;
  for (size_t i = 0; i < l.size(); ++i)
    if (c[i].name != l[i].name || c[i].trainable != l[i].trainable ||
        !fits(c[i].tensor, l[i].tensor, torch::kCPU))
      return false;
  return true;
}

// The live weights copied into `reuse` when they fit it, else into a new CPU copy.
ParamRegistry copy_of(const ParamRegistry& live, std::optional<ParamRegistry> reuse) {
  if (!reuse || !copy_fits(*reuse, live)) return live.cpu_copy();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < live.entries().size(); ++i)
    reuse->entries()[i].tensor.copy_(live.entries()[i].tensor.detach());
  return std::move(*reuse);
}
}  // namespace

RoundInFlight::RoundInFlight(const ParamRegistry& live, int64_t round, int64_t step,
                             int64_t deadline, Exchange exchange, InFlightBuffers reuse)
    : round_(round), step_(step), deadline_(deadline),
      copy_(copy_of(live, std::move(reuse.copy))) {
  torch::NoGradGuard no_grad;
  size_t k = 0;
  for (const auto& e : live.entries()) {
    if (!e.trainable) continue;
    const torch::Tensor w = e.tensor.detach();
    if (k < reuse.uploaded.size() && fits(reuse.uploaded[k], w, w.device()))
      uploaded_.push_back(reuse.uploaded[k].copy_(w));
    else
      uploaded_.push_back(w.clone());
    ++k;
  }
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
    // P + (live - S), in place (the same bits: addition commutes); exactly P when the node
    // has not trained since the upload.
    w.sub_(uploaded_[k++]).add_(published);
  }
}

InFlightBuffers RoundInFlight::release() {
  SPES_CHECK(!result_.valid(), "internal: round {}'s buffers are released while it is in "
             "flight", round_);
  published_ = false;
  InFlightBuffers b{std::move(copy_), std::move(uploaded_)};
  uploaded_.clear();
  return b;
}

uint64_t RoundInFlight::bytes() const {
  uint64_t n = 0;
  for (const auto& e : copy_.entries()) n += e.tensor.numel() * e.tensor.element_size();
  for (const auto& t : uploaded_) n += t.numel() * t.element_size();
  return n;
}

}  // namespace spes::sync
