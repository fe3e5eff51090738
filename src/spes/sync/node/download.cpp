// Receiving a download stream into a node's registry (see download.h).
#include "spes/sync/node/download.h"

#include "spes/common/error.h"
#include "spes/common/strings.h"

namespace spes::sync {

DownloadReceiver::DownloadReceiver(const ParamRegistry& reg, int64_t round, Selection sel,
                                   WireDtype wire, const DeltaUpload* delta, int64_t from_round)
    : reg_(reg), round_(round), sel_(sel), wire_(wire), delta_(delta), from_round_(from_round),
      origin_(fmt::format("download of round {}", round)) {}

void DownloadReceiver::begin(uint64_t total) {
  if (reader_) {
    if (total != total_)
      sync_fail(SyncErrc::DataLoss, "{}: the stream changed size on resume ({} vs {})", origin_,
                total, total_);
    return;
  }
  total_ = total;
  reader_ = std::make_unique<SafetensorsStreamReader>(
      total, origin_, [this](const StreamHeader& h) { check_header(h); }, nullptr,
      kMaxHeaderBytes);
  // Values go straight into the model's tensors, piece by piece (memory: one chunk).
  reader_->set_slice_handler([this](const StreamEntry& e, int64_t first,
                                    const torch::Tensor& run, bool last) {
    if (delta_stream_) (*decoder_)(e, first, run, last);
    else full_run(e, first, run, last);
  });
}

void DownloadReceiver::feed(const char* data, size_t n) {
  SPES_CHECK(reader_, "{}: data before the stream began (internal)", origin_);
  reader_->feed(data, n);
}

void DownloadReceiver::check_header(const StreamHeader& h) {
  auto fmt_it = h.metadata.find("format");
  const std::string format = fmt_it == h.metadata.end() ? "" : fmt_it->second;
  if (format == "spes-download-delta-v1") return check_delta_header(h);
  if (format != "spes-download-v1")
    sync_fail(SyncErrc::InvalidArgument, "{}: not a SPES download (format '{}')", origin_,
              printable(format, 40));
  for (const auto& e : h.entries) {
    const RegistryEntry* r = reg_.find(e.name);
    if (!r) sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is not part of this model",
                      origin_, printable(e.name));
    if (e.shape != r->tensor.sizes().vec())
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' has the wrong shape", origin_,
                e.name);
    if (e.dtype != wire_scalar_type(wire_))
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is {}, expected {}", origin_,
                e.name, safetensors_dtype_name(e.dtype), wire_dtype_name(wire_));
  }
  if (sel_ == Selection::All && h.entries.size() != reg_.entries().size())
    sync_fail(SyncErrc::InvalidArgument, "{}: {} tensors, the model has {}", origin_,
              h.entries.size(), reg_.entries().size());
}

void DownloadReceiver::check_delta_header(const StreamHeader& h) {
  if (!delta_ || !delta_->enabled() || from_round_ < 0 || sel_ != Selection::ForNode)
    sync_fail(SyncErrc::InvalidArgument, "{}: the server sent a delta, which this download did "
              "not ask for", origin_);
  const Compression c = delta_->compression();
  auto meta = [&](const char* key) {
    auto it = h.metadata.find(key);
    return it == h.metadata.end() ? std::string() : it->second;
  };
  if (meta("round") != std::to_string(round_) ||
      meta("from_round") != std::to_string(from_round_) ||
      meta("compression") != compression_name(c))
    sync_fail(SyncErrc::InvalidArgument, "{}: the delta is for round '{}' from round '{}' ({}), "
              "but the node asked for round {} from round {} ({})", origin_,
              printable(meta("round"), 24), printable(meta("from_round"), 24),
              printable(meta("compression"), 24), round_, from_round_, compression_name(c));
  const RegistryEntry* last = nullptr;
  for (const StreamEntry& e : delta_tensor_entries(h.entries, c, origin_)) {
    const RegistryEntry* r = reg_.find(e.name);
    if (!r) sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is not part of this model",
                      origin_, printable(e.name));
    // Registry order, each tensor once: a tensor applied twice would add its delta twice.
    if (last && r <= last)
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is out of model order or repeated",
                origin_, e.name);
    last = r;
    const std::string why =
        delta_entry_problem(e, r->tensor.sizes().vec(), c, delta_->topk_published_params());
    if (!why.empty())
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}': {}", origin_, e.name, why);
  }
  delta_stream_ = true;
  decoder_ = std::make_unique<DeltaStreamDecoder>(
      c, [this](const StreamEntry& e) { return prev_of(e); },
      [this](const StreamEntry& e, int64_t first, const torch::Tensor& out, bool last_run) {
        torch::NoGradGuard ng;
        reg_.find(e.name)->tensor.view({-1}).slice(0, first, first + out.numel()).copy_(out);
        if (last_run) names_.insert(e.name);
      },
      origin_, delta_->topk_published_params());
}

torch::Tensor DownloadReceiver::prev_of(const StreamEntry& e) {
  if (e.name != prev_name_) {
    // A trainable tensor holds the node's training (or its rebuilt upload): its previous
    // published value is the base. A frozen one holds the previous published value itself (a
    // CPU tensor is read in place: each run reads its own range before it is written).
    const torch::Tensor b = delta_->base(e.name);
    prev_ = b.defined() ? b.view({-1})
                        : reg_.find(e.name)->tensor.detach().to(torch::kCPU, torch::kFloat32)
                              .contiguous().view({-1});
    prev_name_ = e.name;
  }
  return prev_;
}

void DownloadReceiver::full_run(const StreamEntry& e, int64_t first, const torch::Tensor& run,
                                bool last) {
  if (run.numel() > 0 && !torch::isfinite(run).all().item<bool>())
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' holds NaN or Inf", origin_, e.name);
  torch::NoGradGuard ng;
  reg_.find(e.name)->tensor.view({-1}).slice(0, first, first + run.numel()).copy_(run);
  if (last) names_.insert(e.name);
}

uint64_t Download::attempt(SyncClient& client) {
  if (receiver.done()) return 0;
  return client.download(
      round, sel, [&](uint64_t t) { receiver.begin(t); },
      [&](const char* p, size_t n) { receiver.feed(p, n); }, receiver.consumed(), from_round);
}

}  // namespace spes::sync
