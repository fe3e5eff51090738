// Top-k sparse deltas as tensors (see topk_codec.h).
#include "spes/sync/wire/topk_codec.h"

#include <cstring>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

TopkParams topk_params(const TransferSettings& t) {
  TopkParams p;
  p.density = t.topk_density;
  p.bits = static_cast<int>(t.topk_bits);
  return p;
}

TopkParams topk_published_params(const TransferSettings& t) {
  TopkParams p = topk_params(t);
  if (t.topk_down_density > 0) p.density = t.topk_down_density;
  return p;
}

TopkEncoded topk_encode_tensor(const torch::Tensor& d, const TopkParams& p,
                               const std::string& name, int coding) {
  const torch::Tensor f = d.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  TopkEncoded out;
  out.deq = torch::empty(f.sizes(), torch::kFloat32);
  const int64_t bad = topk_encode(f.data_ptr<float>(), f.numel(), p, &out.payload,
                                  out.deq.data_ptr<float>(), coding);
  if (bad >= 0)
    sync_fail(SyncErrc::InvalidArgument, "tensor '{}': its delta holds {} at element {}; a "
              "topk delta needs finite values (the node's weights diverged)", name,
              f.data_ptr<float>()[bad], bad);
  return out;
}

TopkSparse topk_decode_checked(const std::string& payload, int64_t numel, const TopkParams& p,
                               const std::string& name, const std::string& origin) {
  TopkSparse s;
  const std::string why = topk_decode(reinterpret_cast<const uint8_t*>(payload.data()),
                                      static_cast<int64_t>(payload.size()), numel, p, &s);
  if (!why.empty())
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}': its topk delta is refused: {}",
              origin, printable(name), why);
  return s;
}

torch::Tensor topk_payload_tensor(const std::string& payload) {
  torch::Tensor t = torch::empty({static_cast<int64_t>(payload.size())}, torch::kUInt8);
  if (!payload.empty()) std::memcpy(t.data_ptr(), payload.data(), payload.size());
  return t;
}

std::string topk_payload_of(const torch::Tensor& bytes) {
  const torch::Tensor b = bytes.to(torch::kCPU).contiguous();
  SPES_CHECK(b.scalar_type() == torch::kUInt8 && b.dim() == 1, "a topk payload is U8 [bytes]");
  return std::string(static_cast<const char*>(b.data_ptr()), static_cast<size_t>(b.numel()));
}

torch::Tensor topk_rebuild_tensor(const torch::Tensor& prev, const TopkSparse& s) {
  const torch::Tensor p = prev.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty(p.sizes(), torch::kFloat32);
  topk_rebuild(p.data_ptr<float>(), s, 0, p.numel(), out.data_ptr<float>());
  return out;
}

}  // namespace spes::sync
