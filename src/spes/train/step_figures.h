// The figures of a training step (gradient norm, loss terms) brought to the host without waiting
// for the device: on a GPU a copy into pinned host memory is queued behind the step's work, with
// an event after it, and the values are read when they are needed (values() waits for that event
// only, not for work queued later: the trainer reads a step's figures after queueing the next
// step). On the CPU the values are at hand at once.
#pragma once
#include <torch/torch.h>

#include <memory>

namespace c10 {
struct Event;
}

namespace spes {

class StepFigures {
 public:
  StepFigures() = default;
  // Queues the copy of `values` (any shape and floating dtype, any device) as fp64.
  explicit StepFigures(const torch::Tensor& values);
  bool defined() const { return host_.defined(); }
  bool ready() const;            // the copy has completed (never waits)
  torch::Tensor values() const;  // fp64 [numel] on the CPU; waits for the copy to complete

 private:
  torch::Tensor host_;
  std::shared_ptr<c10::Event> done_;  // on a GPU: recorded after the copy
};

}  // namespace spes
