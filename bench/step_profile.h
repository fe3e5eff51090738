// One training step under PyTorch's Kineto profiler, from C++: the operators on the CPU and, on
// a GPU, the CUDA kernel timeline (CUPTI; libkineto is part of libtorch_cpu, the CUDA side needs
// libtorch_cuda loaded, train/cuda_library.h). Writes the chrome trace (chrome://tracing,
// Perfetto) and returns a summary: the step's wall time, and a table of the top kernels (GPU:
// time on the device per kernel name) or operators (CPU: self time, children excluded, summed
// over threads, so shares can pass 100% when threads run at once) with their share of the step;
// on a GPU also the device's busy share (all kernels, copies and memsets over the step's wall
// time: far below 1 means the GPU waits for the host).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace spes::bench {

namespace detail {

struct Aggregate {
  int64_t calls = 0;
  double ns = 0;
};

// CPU operators' self time (their duration less that of the operators they called, found by
// nesting the events of each thread in time), by name.
inline void add_self_times(const std::vector<torch::autograd::profiler::KinetoEvent>& events,
                           std::map<std::string, Aggregate>* by_name) {
  struct Span {
    uint64_t start, end;
    std::string name;
    double children = 0;
  };
  std::map<uint64_t, std::vector<Span>> by_thread;
  for (const auto& e : events)
    if (e.deviceType() == c10::DeviceType::CPU && !e.isAsync() && e.durationNs() > 0)
      by_thread[e.startThreadId()].push_back({e.startNs(), e.endNs(), e.name()});
  for (auto& [tid, spans] : by_thread) {
    // Outer spans first at equal starts, so that a child always follows its parent.
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;
    });
    std::vector<Span*> open;
    auto close = [&](Span* s) {
      Aggregate& a = (*by_name)[s->name];
      a.calls += 1;
      a.ns += std::max(0.0, static_cast<double>(s->end - s->start) - s->children);
    };
    for (Span& s : spans) {
      while (!open.empty() && open.back()->end <= s.start) {
        close(open.back());
        open.pop_back();
      }
      if (!open.empty()) open.back()->children += static_cast<double>(s.end - s.start);
      open.push_back(&s);
    }
    for (auto it = open.rbegin(); it != open.rend(); ++it) close(*it);
  }
}

}  // namespace detail

// Runs `step` once under the profiler (CPU activities, and CUDA ones when `cuda`), waiting for
// the device at its end; writes the trace to `trace_path` and returns
// {"trace", "step_s", "what" ("cuda kernels" or "cpu operators, ..."), "top": [{"name",
// "calls", "ms", "share"}, ...] (the `top` largest), "device_busy_share" (GPU)}.
inline nlohmann::json profile_step(const std::function<void()>& step, bool cuda,
                                   const std::string& trace_path, int top = 15) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  const auto t0 = std::chrono::steady_clock::now();
  step();
  if (cuda) torch::cuda::synchronize();
  const double wall_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  result->save(trace_path);

  std::map<std::string, detail::Aggregate> by_name;
  double device_ns = 0;
  if (cuda) {
    for (const auto& e : result->events()) {
      if (e.deviceType() != c10::DeviceType::CUDA) continue;
      detail::Aggregate& a = by_name[e.name()];
      a.calls += 1;
      a.ns += static_cast<double>(e.durationNs());
      device_ns += static_cast<double>(e.durationNs());
    }
  } else {
    detail::add_self_times(result->events(), &by_name);
  }
  std::vector<std::pair<std::string, detail::Aggregate>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  nlohmann::json table = nlohmann::json::array();
  for (size_t i = 0; i < rows.size() && i < static_cast<size_t>(top); ++i) {
    const auto& [name, a] = rows[i];
    table.push_back({{"name", name.size() > 160 ? name.substr(0, 157) + "..." : name},
                     {"calls", a.calls}, {"ms", a.ns / 1e6}, {"share", a.ns / wall_ns}});
  }
  nlohmann::json out = {{"trace", trace_path}, {"step_s", wall_ns / 1e9},
                        {"what", cuda ? "cuda kernels"
                                      : "cpu operators, self time summed over threads"},
                        {"distinct", rows.size()}, {"top", table}};
  if (cuda) out["device_busy_share"] = device_ns / wall_ns;
  return out;
}

}  // namespace spes::bench
