// Expert merging and its schedule (see merge.h).
#include "spes/sync/round/merge.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "spes/common/error.h"

namespace spes::sync {

MergeSchedule MergeSchedule::from_config(const Config& cfg) {
  const auto& s = cfg.spes_config;
  MergeSchedule m;
  m.interval = s.mode == SyncMode::Spes ? std::max<int64_t>(0, s.merging.interval) : 0;
  m.clock = RoundClock(cfg);
  m.decay_steps = s.merging.decay_steps;
  m.alpha_start = s.merging.alpha_start;
  m.topk = s.merging.topk;
  return m;
}

bool MergeSchedule::is_merge_point(int64_t step) const {
  if (interval <= 0 || step <= 0) return false;
  return step / interval > clock.previous_sync_step(step) / interval;
}

double MergeSchedule::alpha(int64_t step) const {
  if (!is_merge_point(step) || topk <= 0) return 0.0;
  if (decay_steps <= 0) return alpha_start;
  return alpha_start * std::max(0.0, 1.0 - static_cast<double>(step) /
                                               static_cast<double>(decay_steps));
}

namespace {

// Fixed-order fp64 dot product (four interleaved partial sums, then a fixed combination).
double dot_f64(const float* a, const float* b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(a[i]) * b[i];
    s1 += static_cast<double>(a[i + 1]) * b[i + 1];
    s2 += static_cast<double>(a[i + 2]) * b[i + 2];
    s3 += static_cast<double>(a[i + 3]) * b[i + 3];
  }
  for (; i < n; ++i) s0 += static_cast<double>(a[i]) * b[i];
  return (s0 + s1) + (s2 + s3);
}

}  // namespace

std::vector<std::vector<double>> gate_cosine_matrix(const std::vector<ExpertMats>& experts) {
  const int64_t E = static_cast<int64_t>(experts.size());
  std::vector<torch::Tensor> g;
  for (const auto& e : experts) g.push_back(e.gate.detach().to(torch::kCPU, torch::kFloat32).contiguous());
  for (int64_t e = 1; e < E; ++e)
    SPES_CHECK(g[e].numel() == g[0].numel(), "merge: experts of a layer differ in shape");
  const int64_t n = E > 0 ? g[0].numel() : 0;
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t a = 0; a < E; ++a)
    for (int64_t b = a; b < E; ++b) pairs.emplace_back(a, b);
  std::vector<double> dots(pairs.size());
  // Each pair is one fixed-order loop on one thread: the result is thread-count independent.
  at::parallel_for(0, static_cast<int64_t>(pairs.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      dots[p] = dot_f64(g[pairs[p].first].data_ptr<float>(), g[pairs[p].second].data_ptr<float>(), n);
  });
  std::vector<std::vector<double>> gram(E, std::vector<double>(E, 0.0));
  for (size_t p = 0; p < pairs.size(); ++p)
    gram[pairs[p].first][pairs[p].second] = gram[pairs[p].second][pairs[p].first] = dots[p];
  std::vector<std::vector<double>> cos(E, std::vector<double>(E, 0.0));
  for (int64_t a = 0; a < E; ++a)
    for (int64_t b = 0; b < E; ++b) {
      const double na = std::sqrt(gram[a][a]), nb = std::sqrt(gram[b][b]);
      cos[a][b] = (na > 0 && nb > 0) ? gram[a][b] / (na * nb) : 0.0;
    }
  return cos;
}

double mean_pairwise(const std::vector<std::vector<double>>& cos) {
  const size_t E = cos.size();
  if (E < 2) return 0.0;
  double s = 0;
  for (size_t a = 0; a < E; ++a)
    for (size_t b = a + 1; b < E; ++b) s += cos[a][b];
  return s / static_cast<double>(E * (E - 1) / 2);
}

std::vector<std::vector<int64_t>> merge_donors(const std::vector<std::vector<double>>& cos,
                                               int64_t k, const std::vector<bool>& excluded) {
  const int64_t E = static_cast<int64_t>(cos.size());
  k = std::max<int64_t>(0, std::min(k, E - 1));
  std::vector<std::vector<int64_t>> donors(E);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> others;
    for (int64_t d = 0; d < E; ++d)
      if (d != e && !(d < static_cast<int64_t>(excluded.size()) && excluded[d]))
        others.push_back(d);
    std::stable_sort(others.begin(), others.end(), [&](int64_t a, int64_t b) {
      return cos[e][a] > cos[e][b];  // stable: ties keep the lower index first
    });
    others.resize(std::min<size_t>(others.size(), static_cast<size_t>(k)));
    std::sort(others.begin(), others.end());
    donors[e] = std::move(others);
  }
  return donors;
}

void experts_merge_layer(std::vector<ExpertMats>& experts,
                         const std::vector<std::vector<int64_t>>& donors, double alpha) {
  const int64_t E = static_cast<int64_t>(experts.size());
  SPES_CHECK(donors.size() == experts.size(), "merge: {} donor lists for {} experts",
             donors.size(), E);
  if (alpha == 0.0) return;
  for (const auto& d : donors)
    for (int64_t j : d)
      SPES_CHECK(j >= 0 && j < E, "merge: donor {} outside the layer's {} experts", j, E);
  const float keep = static_cast<float>(1.0 - alpha), pull = static_cast<float>(alpha);
  for (auto member : {&ExpertMats::gate, &ExpertMats::up, &ExpertMats::down}) {
    std::vector<float*> p(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const torch::Tensor& t = experts[e].*member;
      SPES_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 &&
                     t.is_contiguous() && t.numel() == (experts[0].*member).numel(),
                 "merge: the experts' matrices must be contiguous fp32 CPU tensors of one shape");
      p[e] = t.data_ptr<float>();
    }
    const int64_t n = (experts[0].*member).numel();
    // Every expert's new values of a block are computed from pre-merge values into scratch
    // before the block is written; blocks are disjoint, so they run on several threads.
    constexpr int64_t kBlock = 4096;
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> out(static_cast<size_t>(E * kBlock));
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t lo = b * kBlock, m = std::min(kBlock, n - lo);
        for (int64_t e = 0; e < E; ++e) {
          const auto& d = donors[e];
          if (d.empty()) continue;
          const float count = static_cast<float>(d.size());
          float* o = out.data() + e * kBlock;
          const float* first = p[d[0]] + lo;
          for (int64_t k = 0; k < m; ++k) o[k] = first[k];
          for (size_t j = 1; j < d.size(); ++j) {
            const float* q = p[d[j]] + lo;
            for (int64_t k = 0; k < m; ++k) o[k] += q[k];
          }
          const float* self = p[e] + lo;
          for (int64_t k = 0; k < m; ++k) o[k] = self[k] * keep + pull * (o[k] / count);
        }
        for (int64_t e = 0; e < E; ++e)
          if (!donors[e].empty())
            std::copy_n(out.data() + e * kBlock, m, p[e] + lo);
      }
    });
  }
}

}  // namespace spes::sync
