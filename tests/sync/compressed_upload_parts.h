// A fake node's compressed upload built by hand (what DeltaUpload::encode sends, without its
// base and residual), so that tests and the round_rpc_int8 fuzz target can send any delta and
// break any part of it: per trainable tensor in model order, its scales (int8) and its
// quantised delta (topk: its payload, U8).
#pragma once
#include <functional>

#include "spes/sync/wire/delta_codec.h"
#include "spes/sync/wire/topk_codec.h"
#include "sync/sync_test_util.h"

namespace spes::sync::testing {

inline NamedTensors compressed_upload_parts(
    const FakeNode& n, Compression c,
    const std::function<torch::Tensor(const RegistryEntry&)>& delta) {
  NamedTensors t;
  for (const auto& e : n.reg->entries()) {
    if (!e.trainable) continue;
    if (c == Compression::Topk) {
      const TopkParams p = topk_params(n.cfg.spes_config.transfer);
      t.emplace_back(e.name, topk_payload_tensor(topk_encode_tensor(delta(e), p, e.name).payload));
      continue;
    }
    const EncodedDelta q = delta_encode(delta(e), c, e.name);
    if (q.scales.defined()) t.emplace_back(delta_scale_name(e.name), q.scales);
    t.emplace_back(e.name, q.q);
  }
  return t;
}

}  // namespace spes::sync::testing
