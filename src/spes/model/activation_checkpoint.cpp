// Activation checkpointing (see activation_checkpoint.h): a custom autograd node that keeps x
// and the function, and in backward re-runs the function with grad mode and the forward pass's
// autocast state, then back-propagates the incoming gradients through that recomputed graph.
#include "spes/model/activation_checkpoint.h"

#include <ATen/autocast_mode.h>

#include "spes/common/error.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The function, kept alive in the autograd node (a capsule in its saved data).
struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(CheckpointedFn f) : fn(std::move(f)) {}
  CheckpointedFn fn;
};

// Autocast settings of the devices spes runs on, captured in forward, restored for the
// recomputation (backward runs on an engine thread without them).
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kBFloat16;

  static AutocastState capture() {
    AutocastState s;
    s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    return s;
  }
};

class AutocastRestore {
 public:
  explicit AutocastRestore(const AutocastState& s) : before_(AutocastState::capture()) {
    apply(s);
    at::autocast::increment_nesting();
  }
  ~AutocastRestore() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    apply(before_);
  }

 private:
  static void apply(const AutocastState& s) {
    at::autocast::set_autocast_enabled(at::kCPU, s.cpu);
    at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, s.cuda);
    at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
  }
  AutocastState before_;
};

struct CheckpointFn : public torch::autograd::Function<CheckpointFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x,
                             c10::intrusive_ptr<FnHolder> holder,
                             std::vector<int64_t> non_differentiable) {
    tensor_list outs = holder->fn(x);  // grad mode is off here: no graph, no saved activations
    tensor_list nd;
    for (int64_t i : non_differentiable) nd.push_back(outs.at(i));
    if (!nd.empty()) ctx->mark_non_differentiable(nd);
    const AutocastState ac = AutocastState::capture();
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["autocast"] = std::vector<int64_t>{
        ac.cpu, ac.cuda, static_cast<int64_t>(ac.cpu_dtype), static_cast<int64_t>(ac.cuda_dtype)};
    ctx->save_for_backward({x});
    return outs;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    torch::Tensor x = ctx->get_saved_variables()[0];
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    const auto a = ctx->saved_data["autocast"].toIntVector();
    AutocastState ac;
    ac.cpu = a[0] != 0;
    ac.cuda = a[1] != 0;
    ac.cpu_dtype = static_cast<at::ScalarType>(a[2]);
    ac.cuda_dtype = static_cast<at::ScalarType>(a[3]);
    torch::Tensor xd = x.detach().requires_grad_(true);
    tensor_list outs;
    {
      torch::AutoGradMode grad_on(true);
      AutocastRestore restore(ac);
      outs = holder->fn(xd);
    }
    SPES_CHECK(outs.size() == grads.size(), "internal: checkpointed function returned {} "
               "outputs on recomputation, {} in forward", outs.size(), grads.size());
    tensor_list o, g;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!grads[i].defined() || !outs[i].requires_grad()) continue;
      o.push_back(outs[i]);
      g.push_back(grads[i]);
    }
    if (!o.empty()) torch::autograd::backward(o, g);
    return {xd.grad(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint_apply(const CheckpointedFn& fn, const torch::Tensor& x,
                                            const std::vector<int64_t>& non_differentiable) {
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return fn(x);
  return CheckpointFn::apply(x, c10::make_intrusive<FnHolder>(fn), non_differentiable);
}

}  // namespace spes
