// Compressed delta codec: tensors, names and the stream decoder (see delta_codec.h).
#include "spes/sync/wire/delta_codec.h"

#include <cmath>

#include <fmt/ranges.h>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/sync/wire/protocol.h"
#include "spes/sync/wire/topk_codec.h"

namespace spes::sync {

const char* compression_name(Compression c) {
  return Choice<Compression>::name_of(c).data();  // the names are string literals
}

std::string delta_scale_name(const std::string& tensor) { return tensor + ":scale"; }

torch::ScalarType delta_wire_dtype(Compression c) {
  switch (c) {
    case Compression::Bf16: return torch::kBFloat16;
    case Compression::Int8: return torch::kInt8;
    case Compression::Topk: return torch::kUInt8;
    default: return torch::kFloat32;
  }
}

uint64_t delta_payload_bytes(Compression c, int64_t numel, const TopkParams& p) {
  const uint64_t n = static_cast<uint64_t>(numel);
  switch (c) {
    case Compression::Bf16: return 2 * n;
    case Compression::Int8: return n + 4 * static_cast<uint64_t>(delta_blocks(numel));
    case Compression::Topk: return topk_max_bytes(numel, p);
    default: return 4 * n;
  }
}

std::string delta_entry_problem(const StreamEntry& e, const std::vector<int64_t>& shape,
                                Compression c, const TopkParams& p) {
  const torch::ScalarType want = delta_wire_dtype(c);
  if (e.dtype != want)
    return fmt::format("it is {}, a {} delta carries {}", safetensors_dtype_name(e.dtype),
                       compression_name(c), safetensors_dtype_name(want));
  if (c != Compression::Topk)
    return e.shape == shape ? "" : fmt::format("its shape is [{}], the model's [{}]",
                                               fmt::join(e.shape, ", "), fmt::join(shape, ", "));
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const uint64_t most = topk_max_bytes(numel, p);
  if (e.shape.size() == 1 && e.shape[0] >= kTopkFixedHeader &&
      static_cast<uint64_t>(e.shape[0]) <= most)
    return "";
  return fmt::format("its shape is [{}], but a topk payload of a tensor of {} values is one "
                     "dimension of {} to {} bytes", fmt::join(e.shape, ", "), numel,
                     kTopkFixedHeader, most);
}

EncodedDelta delta_encode(const torch::Tensor& d, Compression c, const std::string& name) {
  SPES_CHECK(c != Compression::None, "delta_encode: no compression");
  const torch::Tensor f = d.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  const int64_t n = f.numel();
  EncodedDelta out;
  int64_t bad = -1;
  if (c == Compression::Int8) {
    out.q = torch::empty(f.sizes(), torch::kInt8);
    out.scales = torch::empty({delta_blocks(n)}, torch::kFloat32);
    bad = delta_quantise_int8(f.data_ptr<float>(), n, out.q.data_ptr<int8_t>(),
                              out.scales.data_ptr<float>());
  } else {
    out.q = torch::empty(f.sizes(), torch::kBFloat16);
    bad = delta_quantise_bf16(f.data_ptr<float>(), n,
                              static_cast<uint16_t*>(out.q.data_ptr()));
  }
  if (bad >= 0)
    sync_fail(SyncErrc::InvalidArgument, "tensor '{}': its delta holds {} at element {}; a "
              "{} delta needs finite values (the node's weights diverged)", name,
              f.data_ptr<float>()[bad], bad, compression_name(c));
  return out;
}

torch::Tensor delta_rebuild(const torch::Tensor& prev, const EncodedDelta& q, Compression c) {
  const int64_t n = q.q.numel();
  torch::Tensor p;
  if (prev.defined()) {
    p = prev.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    SPES_CHECK(p.numel() == n, "delta_rebuild: {} values for a tensor of {}", n, p.numel());
  }
  torch::Tensor out = torch::empty(q.q.sizes(), torch::kFloat32);
  const float* pp = p.defined() ? p.data_ptr<float>() : nullptr;
  if (c == Compression::Int8)
    delta_rebuild_int8(pp, q.q.data_ptr<int8_t>(), q.scales.data_ptr<float>(), 0, n,
                       out.data_ptr<float>());
  else
    delta_rebuild_bf16(pp, static_cast<const uint16_t*>(q.q.data_ptr()), n,
                       out.data_ptr<float>());
  return out;
}

void check_delta_scales(const std::string& tensor, const float* s, int64_t n,
                        const std::string& origin) {
  for (int64_t k = 0; k < n; ++k)
    if (!(s[k] >= 0.0f && s[k] <= kMaxDeltaScale))  // false for NaN too
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}': int8 scale {} of block {} is not a "
                "finite value in [0, {:.4g}]; the stream is refused", origin, tensor, s[k], k,
                kMaxDeltaScale);
}

std::vector<StreamEntry> delta_tensor_entries(const std::vector<StreamEntry>& all, Compression c,
                                              const std::string& origin) {
  if (c != Compression::Int8) return all;
  // int8: entries come in pairs, "NAME:scale" (F32, [blocks]) then NAME.
  std::vector<StreamEntry> got;
  for (size_t k = 1; k < all.size(); k += 2) {
    const StreamEntry& e = all[k];
    const StreamEntry& s = all[k - 1];
    int64_t numel = 1;
    for (int64_t d : e.shape) numel *= d;
    if (s.name != delta_scale_name(e.name) || s.dtype != torch::kFloat32 ||
        s.shape != std::vector<int64_t>{delta_blocks(numel)})
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' must follow its int8 scales "
                "'{}' (F32, [{}]); found '{}' ({}, [{}])", origin, printable(e.name),
                delta_scale_name(printable(e.name)), delta_blocks(numel), printable(s.name),
                safetensors_dtype_name(s.dtype), fmt::join(s.shape, ", "));
    got.push_back(e);
  }
  if (all.size() % 2 != 0)
    sync_fail(SyncErrc::InvalidArgument, "{}: an int8 stream holds pairs of entries (scales, "
              "tensor); '{}' has no pair", origin, printable(all.back().name));
  return got;
}

// ---------------------------------------------------------------------------------------------
DeltaStreamDecoder::DeltaStreamDecoder(Compression c, PrevFn prev,
                                       SafetensorsStreamReader::SliceFn out, std::string origin,
                                       TopkParams topk)
    : c_(c), topk_(topk), prev_(std::move(prev)), out_(std::move(out)),
      origin_(std::move(origin)) {}

void DeltaStreamDecoder::topk_run(const StreamEntry& e, int64_t first, const torch::Tensor& run,
                                  bool last) {
  if (e.dtype != torch::kUInt8)
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is {} but a topk delta stream carries "
              "it as U8", origin_, printable(e.name), safetensors_dtype_name(e.dtype));
  if (first == 0) {
    payload_.clear();
    filling_ = e.name;
  }
  SPES_CHECK(filling_ == e.name && static_cast<uint64_t>(first) == payload_.size(),
             "{}: bytes of '{}' arrive out of place", origin_, printable(e.name));
  payload_.append(static_cast<const char*>(run.data_ptr()), static_cast<size_t>(run.numel()));
  if (!last) return;
  const torch::Tensor prev = prev_(e);
  SPES_CHECK(prev.is_contiguous() && prev.scalar_type() == torch::kFloat32 &&
                 prev.device().is_cpu(),
             "delta decoder: published values of '{}' must be contiguous fp32 on CPU", e.name);
  const int64_t n = prev.numel();
  // Every check of the payload before any value is passed on.
  const TopkSparse s = topk_decode_checked(payload_, n, topk_, e.name, origin_);
  payload_.clear();
  filling_.clear();
  StreamEntry values = e;
  values.dtype = torch::kFloat32;
  values.shape = {n};
  if (n == 0) return out_(values, 0, torch::empty({0}, torch::kFloat32), true);
  torch::Tensor out = torch::empty({std::min(n, kOutValues)}, torch::kFloat32);
  for (int64_t off = 0; off < n; off += kOutValues) {
    const int64_t m = std::min(kOutValues, n - off);
    const torch::Tensor piece = out.slice(0, 0, m);
    topk_rebuild(prev.data_ptr<float>() + off, s, off, m, piece.data_ptr<float>());
    out_(values, off, piece, off + m == n);
  }
}

void DeltaStreamDecoder::operator()(const StreamEntry& e, int64_t first, const torch::Tensor& run,
                                    bool last) {
  if (c_ == Compression::None) return out_(e, first, run, last);
  if (c_ == Compression::Topk) return topk_run(e, first, run, last);
  const int64_t n = run.numel();
  if (c_ == Compression::Int8 && e.dtype == torch::kFloat32) {
    // A scale run ("NAME:scale"; the header check placed it right before NAME).
    const std::string suffix = ":scale";
    if (e.name.size() <= suffix.size() ||
        e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      sync_fail(SyncErrc::InvalidArgument, "{}: '{}' is F32 but only int8 scales are F32 in an "
                "int8 delta stream", origin_, printable(e.name));
    const std::string tensor = e.name.substr(0, e.name.size() - suffix.size());
    if (first == 0) {
      int64_t blocks = 1;
      for (int64_t d : e.shape) blocks *= d;
      scales_ = torch::empty({blocks}, torch::kFloat32);
      filling_ = tensor;
      scales_of_.clear();
    }
    SPES_CHECK(filling_ == tensor && first + n <= scales_.numel(),
               "{}: scales of '{}' arrive out of place", origin_, tensor);
    check_delta_scales(tensor, run.data_ptr<float>(), n, origin_);
    scales_.slice(0, first, first + n).copy_(run);
    if (last) scales_of_ = tensor;
    return;
  }
  const torch::ScalarType want = delta_wire_dtype(c_);
  if (e.dtype != want)
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is {} but a {} delta stream carries "
              "it as {}", origin_, printable(e.name), safetensors_dtype_name(e.dtype), compression_name(c_),
              safetensors_dtype_name(want));
  if (c_ == Compression::Int8) {
    int64_t numel = 1;
    for (int64_t d : e.shape) numel *= d;
    if (scales_of_ != e.name || scales_.numel() != delta_blocks(numel))
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' needs its {} int8 scales ('{}', F32) "
                "right before it", origin_, printable(e.name), delta_blocks(numel),
                delta_scale_name(printable(e.name)));
  }
  if (n == 0) {
    if (last && c_ == Compression::Int8) scales_of_.clear();
    return out_(e, first, torch::empty({0}, torch::kFloat32), last);
  }
  const torch::Tensor prev = prev_(e).slice(0, first, first + n);
  SPES_CHECK(prev.is_contiguous() && prev.scalar_type() == torch::kFloat32 &&
                 prev.device().is_cpu(),
             "delta decoder: published values of '{}' must be contiguous fp32 on CPU", e.name);
  // Rebuilt and passed on in runs of at most kOutValues (one buffer, reused): a large run of
  // int8 values would otherwise need four times its size at once.
  torch::Tensor out = torch::empty({std::min(n, kOutValues)}, torch::kFloat32);
  for (int64_t off = 0; off < n; off += kOutValues) {
    const int64_t m = std::min(kOutValues, n - off);
    const torch::Tensor piece = out.slice(0, 0, m);
    if (c_ == Compression::Int8)
      delta_rebuild_int8(prev.data_ptr<float>() + off, run.data_ptr<int8_t>() + off,
                         scales_.data_ptr<float>(), first + off, m, piece.data_ptr<float>());
    else
      delta_rebuild_bf16(prev.data_ptr<float>() + off,
                         static_cast<const uint16_t*>(run.data_ptr()) + off, m,
                         piece.data_ptr<float>());
    const bool end = last && off + m == n;
    if (end && c_ == Compression::Int8) scales_of_.clear();
    out_(e, first + off, piece, end);
  }
}

}  // namespace spes::sync
