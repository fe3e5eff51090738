// The published change of a top-k run and the server's residual (see sparse_publication.h).
#include "spes/sync/round/sparse_publication.h"

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/io/safetensors.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

SparsePublisher::SparsePublisher(TopkParams p, size_t tensors) : residual_(p, 1.0) {
  residual_.reset(tensors);
}

std::string SparsePublisher::publish(size_t i, const torch::Tensor& prev, torch::Tensor& agg,
                                     const std::string& name) {
  SPES_CHECK(agg.is_contiguous() && agg.device().is_cpu() && agg.scalar_type() == torch::kFloat32,
             "publication: '{}' must be contiguous fp32 on CPU (internal)", name);
  const torch::Tensor p = prev.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  TopkEncoded e = residual_.encode(i, agg - p.view(agg.sizes()), name);
  // P_new through the same checked decode and rebuild as every node's.
  const TopkSparse s = topk_decode_checked(e.payload, agg.numel(), residual_.params(), name,
                                           "publication");
  topk_rebuild(p.data_ptr<float>(), s, 0, agg.numel(), agg.data_ptr<float>());
  return std::move(e.payload);
}

void SparsePublisher::publish_exact(size_t i) {
  std::vector<torch::Tensor> held = residual_.state();
  held.at(i) = torch::Tensor();
  residual_.restore(std::move(held));
}

void SparsePublisher::save(const std::string& path, const std::vector<std::string>& names,
                           int64_t round, const std::string& model_sha256) const {
  const auto& held = residual_.state();
  SPES_CHECK(names.size() == held.size(), "residual: {} names for {} tensors (internal)",
             names.size(), held.size());
  NamedTensors out;
  for (size_t i = 0; i < held.size(); ++i)
    if (held[i].defined()) out.emplace_back(names[i], held[i].flatten());
  // Streamed piece by piece (never a second copy of R in memory), atomically and durably.
  write_stream_file(path, SafetensorsStreamWriter(std::move(out), torch::kFloat32,
                                                  {{"format", "spes-residual-v1"},
                                                   {"round", std::to_string(round)},
                                                   {"model_sha256", model_sha256}}));
}

bool SparsePublisher::load(const std::string& path, const std::vector<std::string>& names,
                           const std::vector<int64_t>& numels, int64_t round,
                           const std::string& model_sha256) {
  residual_.reset(names.size());
  if (!file_exists(path)) return false;
  Metadata md;
  NamedTensors got;
  try {
    got = safetensors_load(path, &md);
  } catch (const std::exception&) {
    return false;  // damaged: the residual restarts at zero
  }
  if (md["format"] != "spes-residual-v1" || md["round"] != std::to_string(round) ||
      md["model_sha256"] != model_sha256)
    return false;
  std::vector<torch::Tensor> held(names.size());
  size_t next = 0;
  for (auto& [name, t] : got) {
    while (next < names.size() && names[next] != name) ++next;
    if (next == names.size() || t.scalar_type() != torch::kFloat32 || t.dim() != 1 ||
        t.numel() != numels[next])
      return false;
    if (!torch::isfinite(t).all().item<bool>()) return false;
    held[next++] = t.contiguous();
  }
  residual_.restore(std::move(held));
  return true;
}

}  // namespace spes::sync
