// Top-k sparse deltas as tensors (spes_config.compression: topk; docs/PROTOCOL.md, "Sparse
// deltas"): one tensor's payload (a byte string, layout in topk_kernels.h) from an fp32 tensor
// and back, with the run's settings, and the checked decode that names the tensor and the
// sender in its refusal. Leaves out: the arithmetic and layout (topk_kernels.h), what a sender
// keeps between rounds (round/topk_feedback.h).
#pragma once
#include <torch/torch.h>

#include <string>

#include "spes/io/config.h"
#include "spes/sync/wire/topk_kernels.h"

namespace spes::sync {

// The codec's parameters of a run (topk_density, topk_bits): an upload's, and an owner's
// expert as published.
TopkParams topk_params(const TransferSettings& t);
// The parameters of a published delta (topk_down_density, else topk_density; topk_bits): the
// server's change of an averaged tensor is at most this dense, and so is any published tensor.
TopkParams topk_published_params(const TransferSettings& t);

// One tensor's payload and the dense dequantised values it carries (fp32 CPU, d's shape; 0
// where nothing was sent).
struct TopkEncoded {
  std::string payload;
  torch::Tensor deq;
};
// Encodes an fp32 tensor (any device; computed on CPU). Throws SyncError(InvalidArgument)
// naming `name` when d holds NaN/Inf.
TopkEncoded topk_encode_tensor(const torch::Tensor& d, const TopkParams& p,
                               const std::string& name, int coding = -1);

// Decodes a payload for a tensor of `numel` values; a payload that fails any check of
// topk_decode is refused with SyncError(InvalidArgument): "ORIGIN: tensor 'NAME': REASON".
TopkSparse topk_decode_checked(const std::string& payload, int64_t numel, const TopkParams& p,
                               const std::string& name, const std::string& origin);

// A payload as the U8 tensor [bytes] it travels as in a stream entry, and back.
torch::Tensor topk_payload_tensor(const std::string& payload);
std::string topk_payload_of(const torch::Tensor& bytes);

// prev + deq as a new fp32 CPU tensor of prev's shape (the exact bits every side rebuilds).
torch::Tensor topk_rebuild_tensor(const torch::Tensor& prev, const TopkSparse& s);

}  // namespace spes::sync
