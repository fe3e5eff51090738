// SPES node sync observer (see node.h).
#include "spes/sync/node.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <random>
#include <set>
#include <thread>

#include <fmt/ranges.h>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/sync/client.h"
#include "spes/sync/framing.h"
#include "spes/sync/plan.h"

namespace spes::sync {

namespace {
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool retryable(SyncErrc c) {
  return c == SyncErrc::Unavailable || c == SyncErrc::DataLoss || c == SyncErrc::Aborted ||
         c == SyncErrc::DeadlineExceeded;
}

// Runs `f`, retrying retryable failures with backoff (0.2 s doubling to 5 s) until `limit_s`.
template <class F>
auto with_retry(const char* what, double limit_s, F&& f) -> decltype(f()) {
  const auto start = Clock::now();
  double backoff = 0.2;
  for (int attempt = 1;; ++attempt) {
    try {
      return f();
    } catch (const SyncError& e) {
      if (!retryable(e.code()) || since(start) + backoff > limit_s) throw;
      spdlog::warn("{} failed (attempt {}): {}; retrying in {:.1f} s", what, attempt, e.what(),
                   backoff);
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(backoff * 1000)));
      backoff = std::min(5.0, backoff * 2);
    }
  }
}

// Downloads a round into the registry's tensors; returns the bytes and the names loaded.
uint64_t download_into(SyncClient& client, const ParamRegistry& reg, int64_t round,
                       Selection sel, WireDtype wire, std::set<std::string>* names) {
  names->clear();
  std::unique_ptr<SafetensorsStreamReader> reader;
  const std::string origin = fmt::format("download of round {}", round);
  auto on_header = [&](const StreamHeader& h) {
    for (const auto& e : h.entries) {
      const RegistryEntry* r = reg.find(e.name);
      if (!r) sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is not part of this model",
                        origin, e.name);
      if (e.shape != r->tensor.sizes().vec())
        sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' has the wrong shape", origin,
                  e.name);
      if (e.dtype != wire_scalar_type(wire))
        sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is {}, expected {}", origin,
                  e.name, safetensors_dtype_name(e.dtype), wire_dtype_name(wire));
    }
    if (sel == Selection::All && h.entries.size() != reg.entries().size())
      sync_fail(SyncErrc::InvalidArgument, "{}: {} tensors, the model has {}", origin,
                h.entries.size(), reg.entries().size());
  };
  // Values go straight into the model's tensors, piece by piece (memory: one chunk).
  auto on_run = [&](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last) {
    if (run.numel() > 0 && !torch::isfinite(run).all().item<bool>())
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' holds NaN or Inf", origin, e.name);
    torch::NoGradGuard ng;
    reg.find(e.name)->tensor.view({-1}).slice(0, first, first + run.numel()).copy_(run);
    if (last) names->insert(e.name);
  };
  return client.download(
      round, sel,
      [&](uint64_t total) {
        reader = std::make_unique<SafetensorsStreamReader>(total, origin, on_header, nullptr,
                                                           kMaxHeaderBytes);
        reader->set_slice_handler(on_run);
      },
      [&](const char* p, size_t n) { reader->feed(p, n); });
}

uint64_t random_incarnation() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}
}  // namespace

std::string frozen_weights_sha256(const ParamRegistry& registry) {
  Sha256 h;
  for (const auto& e : registry.entries()) {
    if (e.trainable) continue;
    h.update(e.name.data(), e.name.size());
    torch::Tensor t = e.tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    h.update(t.data_ptr(), t.numel() * sizeof(float));
  }
  return h.hex_digest();
}

SyncNode::SyncNode(NodeOptions opts) : opts_(std::move(opts)) {}
SyncNode::~SyncNode() = default;

void SyncNode::on_start(Trainer& t) {
  const Config& cfg = t.config();
  const ParamRegistry& reg = t.registry();
  SPES_CHECK(cfg.spes_config.mode != "centralized", "spes node: spes_config.mode is centralized; "
             "set it to spes, fedavg or diloco (the server uses the same config)");
  const WireDtype wire = wire_dtype_from_string(cfg.spes_config.transfer_dtype);
  NodeId id{reg.node_id(), random_incarnation(), opts_.auth_token};
  client_ = std::make_unique<SyncClient>(opts_.server, id);
  const auto t0 = Clock::now();
  const JoinInfo info = node_join_info(cfg, reg, id, t.state().step);
  spdlog::info("node {}: joining sync server {} (incarnation {:x})", id.node_id, opts_.server,
               id.incarnation);
  const JoinResult jr = with_retry("join", opts_.connect_timeout_s, [&] {
    if (!client_->wait_connected(std::min(5.0, opts_.connect_timeout_s)))
      sync_fail(SyncErrc::Unavailable, "cannot connect to sync server {} within {:.0f} s (is "
                "`spes serve` running there? --connect-timeout sets how long to keep trying)",
                opts_.server, opts_.connect_timeout_s);
    return client_->join(info);
  });
  std::set<std::string> names;
  const uint64_t down = with_retry("initial download", 60, [&] {
    return download_into(*client_, reg, jr.published_round, Selection::All, wire, &names);
  });
  const std::string sha = reg.weights_sha256();
  SPES_CHECK(sha == jr.model_sha256, "node {}: after loading round {} its weights hash to {} "
             "but the server published {}", id.node_id, jr.published_round, sha,
             jr.model_sha256);
  frozen_sha_ = frozen_weights_sha256(reg);
  tokens_at_sync_ = t.state().tokens;
  t.state().sync_round = jr.published_round;
  int64_t grad_numel = 0;
  for (const auto& e : reg.entries())
    if (e.tensor.requires_grad()) grad_numel += e.tensor.numel();
  const UploadMeta probe{id.node_id, 0, 0, 0, id.incarnation, reg.fingerprint()};
  join_record_ = {{"round", jr.published_round},
                  {"model_sha256", sha},
                  {"frozen_sha256", frozen_sha_},
                  {"bytes_down", down},
                  {"seconds", since(t0)},
                  {"trainable_numel", reg.trainable_numel()},
                  {"frozen_numel", reg.frozen_numel()},
                  {"grad_numel", grad_numel},
                  {"optimizer_state_bytes", t.optimizer().state_bytes()},
                  {"upload_data_bytes", node_upload_writer(reg, probe, wire).data_bytes()}};
  spdlog::info("node {}: joined at round {} (step {}), loaded {} ({}), model sha256 {}",
               id.node_id, jr.published_round, jr.published_step, human_bytes(down),
               wire_dtype_name(wire), sha.substr(0, 16));
}

nlohmann::json SyncNode::after_step(Trainer& t, int64_t step) {
  nlohmann::json out = nlohmann::json::object();
  if (!join_record_.is_null()) {
    out["sync_join"] = join_record_;
    join_record_ = nullptr;
  }
  if (step % t.config().spes_config.sync_steps == 0) out["sync"] = sync_round(t, step);
  return out;
}

nlohmann::json SyncNode::sync_round(Trainer& t, int64_t step) {
  const Config& cfg = t.config();
  const ParamRegistry& reg = t.registry();
  const WireDtype wire = wire_dtype_from_string(cfg.spes_config.transfer_dtype);
  const int64_t node = reg.node_id();
  const int64_t round = step / cfg.spes_config.sync_steps;
  const auto t0 = Clock::now();
  const std::string frozen_before = frozen_weights_sha256(reg);

  // 1. Upload the trainable tensors.
  UploadMeta meta{node, round, step, t.state().tokens - tokens_at_sync_,
                  client_->id().incarnation, reg.fingerprint()};
  const SafetensorsStreamWriter payload = node_upload_writer(reg, meta, wire);
  const UploadResult up = with_retry("upload", 300, [&] {
    return client_->upload(round, step, payload);
  });
  const double upload_s = since(t0);

  // 2. Long-poll until the round is published.
  const auto t1 = Clock::now();
  const double limit = opts_.round_wait_s > 0
                           ? opts_.round_wait_s
                           : std::max(600.0, 2 * cfg.spes_config.round_timeout);
  RoundStatus st;
  double last_log = 0;
  for (;;) {
    st = with_retry("wait for round", 120, [&] { return client_->wait_round(round, kMaxWaitMs); });
    if (st.published) break;
    if (since(t1) > limit)
      fail("node {}: round {} was not published within {:.0f} s (waiting for node(s) [{}])",
           node, round, limit, fmt::join(st.waiting_for, ", "));
    if (since(t1) - last_log >= 30) {
      last_log = since(t1);
      spdlog::info("node {}: round {} waits for node(s) [{}] ({:.0f} s)", node, round,
                   fmt::join(st.waiting_for, ", "), since(t1));
    }
  }
  SPES_CHECK(st.published_round == round, "node {}: the server moved on to round {} while this "
             "node waited for round {}", node, st.published_round, round);
  const double wait_s = since(t1);

  // 3. Download what the node lacks; tensors it uploaded and does not get back already hold
  // the published value up to rounding to the transfer dtype, which we apply here.
  const auto t2 = Clock::now();
  std::set<std::string> got;
  const uint64_t down = with_retry("download", 120, [&] {
    return download_into(*client_, reg, round, Selection::ForNode, wire, &got);
  });
  for (const auto& e : reg.entries())
    if (e.trainable && !got.count(e.name)) wire_round_(e.tensor, wire);
  const double download_s = since(t2);

  const std::string sha = reg.weights_sha256();
  SPES_CHECK(sha == st.model_sha256, "node {}: after loading round {} its weights hash to {} but "
             "the server published {} (the node and server disagree about the model)", node,
             round, sha, st.model_sha256);
  const std::string frozen_after = frozen_weights_sha256(reg);
  SPES_CHECK(frozen_before == frozen_sha_, "node {}: frozen experts changed between syncs "
             "(they must only change through a sync)", node);
  frozen_sha_ = frozen_after;
  tokens_at_sync_ = t.state().tokens;
  t.state().sync_round = round;
  spdlog::info("node {}: round {} (step {}): up {}, down {}, upload {:.2f} s, wait {:.2f} s, "
               "download {:.2f} s{}, sha256 {}", node, round, step,
               human_bytes(static_cast<double>(up.bytes)), human_bytes(static_cast<double>(down)),
               upload_s, wait_s, download_s,
               st.alpha > 0 ? fmt::format(", merged (alpha {:.4g})", st.alpha) : "",
               sha.substr(0, 16));
  return {{"round", round},
          {"step", step},
          {"bytes_up", up.bytes},
          {"bytes_down", down},
          {"model_sha256", sha},
          {"alpha", st.alpha},
          {"tokens", meta.tokens},
          {"upload_s", upload_s},
          {"wait_s", wait_s},
          {"download_s", download_s},
          {"seconds", since(t0)},
          {"frozen_sha256_before", frozen_before},
          {"frozen_sha256_after", frozen_after}};
}

void SyncNode::on_finish(Trainer& t) {
  if (!client_) return;
  try {
    client_->leave(t.state().step, "finished");
  } catch (const std::exception& e) {
    spdlog::warn("node {}: leave failed: {}", client_->id().node_id, e.what());
  }
}

}  // namespace spes::sync
