// Compressed deltas on the wire (docs/PROTOCOL.md, "Compressed deltas"): with
// spes_config.compression bf16 or int8 an upload carries, per tensor, q = Q(d) of the node's
// delta d from the published model instead of the tensor. In the safetensors stream, per
// tensor in model order: int8: "NAME:scale" (F32, [blocks], one scale per kDeltaBlock values)
// then "NAME" (I8, the tensor's shape); bf16: "NAME" (BF16). The receiver turns the stream
// back into runs of rebuilt fp32 values U = P_prev + deq(q) (DeltaStreamDecoder), so every
// check and the aggregation see the upload as the node meant it.
// Leaves out: the scalar arithmetic (delta_kernels.h), what a node keeps between rounds
// (round/delta_upload.h), which tensors an upload holds (round/plan.h).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "spes/sync/wire/delta_kernels.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/topk_kernels.h"

namespace spes::sync {

// spes_config.compression (io/config.h) names the encoding: none, bf16, int8 or topk (a
// tensor's top-k payload travels as one U8 entry NAME of its own length, [bytes]; the layout
// in topk_kernels.h).
const char* compression_name(Compression c);

// The companion tensor carrying NAME's int8 scales.
std::string delta_scale_name(const std::string& tensor);
// The dtype NAME itself travels in (F32 without compression).
torch::ScalarType delta_wire_dtype(Compression c);
// Payload bytes of one tensor of `numel` values (with its scales); topk: the most a valid
// payload can take (topk_max_bytes).
uint64_t delta_payload_bytes(Compression c, int64_t numel, const TopkParams& p = {});
// Why stream entry `e` cannot be the delta of a model tensor of `shape` ("" when it can): the
// delta dtype, and the tensor's shape (topk: one dimension, a byte count a valid payload can
// have, kTopkFixedHeader to topk_max_bytes).
std::string delta_entry_problem(const StreamEntry& e, const std::vector<int64_t>& shape,
                                Compression c, const TopkParams& p);

// One tensor's quantised delta: q (I8 or BF16, shape of the tensor) and, for int8, its scales
// (F32, [blocks]).
struct EncodedDelta {
  torch::Tensor q, scales;
};
// Q(d) of an fp32 delta (any device; computed on CPU). Throws SyncError(InvalidArgument)
// naming `name` when d holds NaN/Inf (or, for bf16, a value beyond bf16's range).
EncodedDelta delta_encode(const torch::Tensor& d, Compression c, const std::string& name);
// prev + deq(q) as a new fp32 CPU tensor of prev's shape (prev undefined: deq(q) alone), with
// the same kernel the stream decoder uses: the exact fp32 bits the server rebuilds.
torch::Tensor delta_rebuild(const torch::Tensor& prev, const EncodedDelta& q, Compression c);

// Checks a run of int8 scales: each finite, >= 0 and <= kMaxDeltaScale; throws
// SyncError(InvalidArgument) naming the tensor and the first bad scale.
void check_delta_scales(const std::string& tensor, const float* s, int64_t n,
                        const std::string& origin);

// The tensor entries of a compressed stream's header (int8: every "NAME:scale" entry checked
// to come right before NAME, F32, [blocks of NAME]; bf16 and none: every entry). Throws
// SyncError(InvalidArgument) naming the first misplaced or malformed scale entry. What the
// tensors themselves must be (names, shapes, dtypes) is the caller's check.
std::vector<StreamEntry> delta_tensor_entries(const std::vector<StreamEntry>& all, Compression c,
                                              const std::string& origin);

// Turns the runs of a compressed stream (SafetensorsStreamReader slice mode) into runs of
// rebuilt fp32 values P_prev + deq(q), passed on with the tensor's own name, each at most
// kOutValues long (one reused buffer: a consumer must not keep a run); scale entries are
// consumed here (held for one tensor at a time). With Compression::None runs pass through.
// `prev(entry)`: the tensor's published fp32 values (CPU, contiguous, flattened).
// topk: a tensor's payload bytes are held until its entry is complete (at most topk_max_bytes),
// then decoded with every check of topk_decode (a refusal names `origin` and the tensor) before
// any value is passed on, as runs of an entry of the same name, F32, shape [values].
class DeltaStreamDecoder {
 public:
  static constexpr int64_t kOutValues = int64_t{1} << 18;  // 1 MiB of fp32
  using PrevFn = std::function<torch::Tensor(const StreamEntry&)>;
  DeltaStreamDecoder(Compression c, PrevFn prev, SafetensorsStreamReader::SliceFn out,
                     std::string origin, TopkParams topk = {});
  void operator()(const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last);

 private:
  void topk_run(const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last);
  Compression c_;
  TopkParams topk_;
  std::string payload_;        // topk: the bytes of tensor filling_ so far
  PrevFn prev_;
  SafetensorsStreamReader::SliceFn out_;
  std::string origin_;
  std::string scales_of_;      // tensor whose scales are complete in scales_
  std::string filling_;        // tensor whose scales are arriving
  torch::Tensor scales_;
};

}  // namespace spes::sync
