// The sync server's state on disk and its restart (see round_store.h).
#include "spes/sync/server/round_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <filesystem>

#include "spes/common/strings.h"
#include "spes/common/timing.h"
#include "spes/io/files.h"
#include "spes/io/format_version.h"
#include "spes/io/run_layout.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {
namespace fs = std::filesystem;

RoundStore::RoundStore(const Config& cfg, std::string dir, bool keep_copies, SyncModel& model,
                       uint64_t incarnation)
    : cfg_(cfg), dir_(std::move(dir)), keep_copies_(keep_copies), model_(model),
      incarnation_(incarnation) {
  SPES_CHECK(!dir_.empty(), "sync server: an output directory is required");
  fs::create_directories(dir_);
  remove_leftovers();
}

void RoundStore::remove_leftovers() const {
  // What a crash of this server can leave: temporary files of its atomic writes
  // (state.json.tmp.PID, published.safetensors.tmp.PID, delta.safetensors.tmp.PID,
  // momentum-R.safetensors.tmp.PID, residual.safetensors.tmp.PID) and
  // partial kept uploads (rounds/<r>/node<i>.safetensors.partial<k>). Only the server's own
  // names: DIR may also hold the nodes' folders of a local cluster.
  auto own_tmp = [](const std::string& name) {
    return name.find(".tmp.") != std::string::npos &&
           (starts_with(name, "state.json.") || starts_with(name, "published.safetensors.") ||
            starts_with(name, "delta.safetensors.") || starts_with(name, "momentum-") ||
            starts_with(name, "residual.safetensors."));
  };
  std::error_code ec;
  std::vector<fs::path> doomed;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (e.is_regular_file(ec) && own_tmp(e.path().filename().string())) doomed.push_back(e.path());
  for (const auto& r : fs::directory_iterator(run_layout::kept_rounds(dir_), ec))
    for (const auto& e : fs::directory_iterator(r.path(), ec))
      if (e.path().filename().string().find(".safetensors.partial") != std::string::npos)
        doomed.push_back(e.path());
  for (const auto& p : doomed) {
    spdlog::info("sync server: removing '{}' (left by an interrupted run)", p.string());
    fs::remove(p, ec);
  }
}

std::string RoundStore::momentum_path(int64_t round) const {
  return run_layout::momentum(dir_, round);
}

std::optional<PublishedRound> RoundStore::resume() {
  if (!fs::exists(run_layout::server_state(dir_))) return std::nullopt;
  const nlohmann::json st = read_state_for_this_run();
  const Metadata md = load_published_model();
  PublishedRound p;
  p.round = std::stoll(md.at("round"));
  p.step = std::stoll(md.at("step"));
  p.sha256 = check_published_digest(md.at("model_sha256"));
  if (st.value("round", int64_t{-1}) == p.round) {
    p.alpha = st.value("alpha", 0.0);
    p.merged = st.value("merged", false);
    p.nodes = st.value("nodes", std::vector<int64_t>{});
  }
  if (cfg_.spes_config.uses_outer_step() && p.round > 0) load_momentum(p.round);
  spdlog::info("sync server: resuming from '{}' at round {} (step {})", dir_, p.round, p.step);
  return p;
}

nlohmann::json RoundStore::read_state_for_this_run() const {
  nlohmann::json st;
  try {
    st = nlohmann::json::parse(file_read(run_layout::server_state(dir_)));
  } catch (const std::exception& e) {
    fail("'{}/state.json' is corrupt ({}); restore it or start over with --overwrite", dir_,
         e.what());
  }
  SPES_CHECK(st.is_object() && st.contains("format") && st["format"].is_string(),
             "'{}/state.json' is not a sync server state; start over with --overwrite", dir_);
  format_version(st["format"].get<std::string>(), kServerStateFormat, kServerStateFormatVersion,
                 run_layout::server_state(dir_));
  auto same = [&](const char* key, const std::string& mine) {
    SPES_CHECK(st.value(key, "") == mine, "'{}' holds a run with a different {} ({} vs {}); "
               "use the same config, another --out, or --overwrite to start over", dir_, key,
               st.value(key, ""), mine);
  };
  same("mode", cfg_.spes_config.mode.name());
  same("model_fingerprint", model_.model_fingerprint());
  same("ownership_fingerprint", model_.ownership_fingerprint());
  return st;
}

Metadata RoundStore::load_published_model() {
  // The published file is authoritative (it is renamed into place before state.json): load it
  // piece by piece into the model; its digest is checked next.
  const std::string path = published_path();
  SPES_CHECK(fs::exists(path), "'{}' has state.json but no published.safetensors; restore it "
             "or start over with --overwrite", dir_);
  const StreamHeader h = read_stream_header(path);
  const RoundPlan& plan = model_.plan();
  SPES_CHECK(h.entries.size() == plan.tensors().size(), "'{}' holds {} tensors, the model has "
             "{}; start over with --overwrite", path, h.entries.size(), plan.tensors().size());
  SafetensorsStreamReader reader(fs::file_size(path), path, [&](const StreamHeader& hh) {
    for (const auto& e : hh.entries) {
      const int64_t i = plan.index(e.name);
      SPES_CHECK(i >= 0 && e.shape == plan.tensors()[i].shape && e.dtype == torch::kFloat32,
                 "'{}': tensor '{}' does not match the model", path, e.name);
    }
  }, nullptr);
  reader.set_slice_handler([&](const StreamEntry& e, int64_t first, const torch::Tensor& run,
                               bool) {
    torch::NoGradGuard ng;
    model_.tensors()[plan.index(e.name)].view({-1}).slice(0, first, first + run.numel())
        .copy_(run);
  });
  stream_file(path, reader);
  const Metadata& md = h.metadata;
  SPES_CHECK(md.count("round") && md.count("step") && md.count("model_sha256"),
             "'{}' lacks its round metadata; start over with --overwrite", path);
  return md;
}

std::string RoundStore::check_published_digest(const std::string& written) const {
  const std::string sha = model_.weights_sha256();
  if (sha == written) return sha;
  // Written by a server of sync protocol 1-4, whose digest was one pass over all the weights:
  // the same model, named by this version's digest from now on.
  SPES_CHECK(model_.flat_weights_sha256() == written, "'{}' is corrupt: its weights hash to {} "
             "but it was written with {}; restore it or start over with --overwrite",
             published_path(), sha, written);
  spdlog::info("'{}' was written by an earlier version (model digest {} over all weights at "
               "once); its digest is now {} (per tensor, sync protocol {}), and nodes of the "
               "earlier version cannot join", published_path(), written.substr(0, 16),
               sha.substr(0, 16), kProtocolVersion);
  return sha;
}

void RoundStore::load_momentum(int64_t round) {
  const std::string path = momentum_path(round);
  SPES_CHECK(fs::exists(path), "'{}' is missing (outer-step momentum of round {}); start over "
             "with --overwrite", path, round);
  model_.load_momentum(safetensors_load(path), path);
}

void RoundStore::save_drift_window(const PublishedRound& p, const nlohmann::json& window) {
  const nlohmann::json j = {{"format", "spes-drift-window-v1"},
                            {"round", p.round},
                            {"model_sha256", p.sha256},
                            {"window", window}};
  const int64_t round = p.round;
  background_.post(fmt::format("saving the drift window of round {}", round),
                   [this, round, text = j.dump()] {
    try {
      file_write_atomic(run_layout::drift_window(dir_), text);
    } catch (const std::exception& e) {
      spdlog::warn("round {}: the drift window could not be saved ({}); a restart would start "
                   "it empty", round, e.what());
    }
  });
}

void RoundStore::defer(std::string what, std::function<void()> job) {
  background_.post(std::move(what), std::move(job));
}

void RoundStore::flush() { background_.wait(); }

nlohmann::json RoundStore::load_drift_window(const PublishedRound& p) const {
  const std::string path = run_layout::drift_window(dir_);
  if (!fs::exists(path)) return nullptr;
  try {
    const nlohmann::json j = nlohmann::json::parse(file_read(path));
    if (j.value("format", "") == "spes-drift-window-v1" &&
        j.value("round", int64_t{-1}) == p.round && j.value("model_sha256", "") == p.sha256 &&
        j.contains("window"))
      return j["window"];
    spdlog::warn("'{}' is not the drift window of round {}; the window starts empty", path,
                 p.round);
  } catch (const std::exception& e) {
    spdlog::warn("'{}' is unreadable ({}); the drift window starts empty", path, e.what());
  }
  return nullptr;
}

nlohmann::json RoundStore::saved_line() const {
  const nlohmann::json st = nlohmann::json::parse(file_read(run_layout::server_state(dir_)));
  if (st.contains("line") && st["line"].is_object()) return st["line"];
  return nullptr;
}

std::optional<DeltaRecord> RoundStore::load_delta(const PublishedRound& p) const {
  const std::string path = delta_path();
  if (!fs::exists(path)) return std::nullopt;
  try {
    const DeltaRecord r = delta_record_of(model_.plan(), read_stream_header(path), path);
    if (r.round == p.round && r.model_sha256 == p.sha256) return r;
    spdlog::info("'{}' is the delta of round {}, not of the resumed round {}: nodes get full "
                 "tensors for this round", path, r.round, p.round);
  } catch (const std::exception& e) {
    spdlog::warn("'{}' is unusable ({}); nodes get full tensors for round {}", path, e.what(),
                 p.round);
  }
  return std::nullopt;
}

std::unique_ptr<DeltaFileWriter> RoundStore::begin_delta(const PublishedDelta& layout,
                                                         int64_t round,
                                                         int64_t from_round) const {
  try {
    return std::make_unique<DeltaFileWriter>(model_.plan(), delta_path(), layout.tensors,
                                             layout.owner_exact, round, from_round);
  } catch (const std::exception& e) {
    spdlog::warn("round {}: the delta file cannot be created ({}); nodes get full tensors for "
                 "this round", round, e.what());
    return nullptr;
  }
}

bool RoundStore::commit_delta(DeltaFileWriter& file, const DeltaRecord& record) const {
  try {
    file.commit(record);
    return true;
  } catch (const std::exception& e) {
    spdlog::warn("round {}: the delta file could not be written ({}); nodes get full tensors "
                 "for this round", record.round, e.what());
    return false;
  }
}

std::string RoundStore::persist(const PublishedRound& p, const nlohmann::json& line) {
  // The previous round's background work first (removing the file it replaced, its staged
  // uploads): nothing of it may touch this round's files.
  background_.wait();
  // Order (the round's delta is already in place, commit_delta): momentum of the round, then
  // the published model (authoritative on restart; a delta of a round it does not describe is
  // ignored), then state.json; each written to a temporary name, fsynced and renamed.
  const bool outer = cfg_.spes_config.uses_outer_step();
  if (outer) write_momentum(p.round);
  std::string replaced;
  const std::string sha = write_published_model(p, &replaced);
  write_state(p, sha, line);
  if (keep_copies_) keep_round_copies(p.round, outer);
  const int64_t round = p.round;
  background_.post(fmt::format("cleaning up after round {}", round),
                   [this, outer, round, replaced] {
    std::error_code ec;
    if (!replaced.empty()) fs::remove(replaced, ec);
    if (outer && round > 1) fs::remove(momentum_path(round - 1), ec);
  });
  return sha;
}

void RoundStore::write_momentum(int64_t round) {
  write_stream_file(momentum_path(round),
                    SafetensorsStreamWriter(model_.momentum_named(), torch::kFloat32,
                                            {{"format", "spes-momentum-v1"},
                                             {"round", std::to_string(round)}}));
}

std::string RoundStore::write_published_model(const PublishedRound& p, std::string* replaced) {
  // Written past the page cache (write_stream_file); the file it replaces is moved aside
  // (`replaced`) for removal in the background. Without the digest, it is computed on another
  // thread while the disk writes the file (the writing thread mostly waits for it), its header
  // holding a placeholder of the same length that is replaced before the file is synced. (Both
  // threads only read the weights.)
  std::string sha = p.sha256;
  std::future<std::string> digest;
  if (sha.empty())
    digest = std::async(std::launch::async, [this] { return model_.weights_sha256(); });
  const std::string placeholder(64, '0');
  *replaced = write_stream_file(
      published_path(),
      published_writer(model_, p.round, p.step, sha.empty() ? placeholder : sha),
      /*set_aside_replaced=*/true, [&](std::string* head) {
        if (!digest.valid()) return;
        sha = digest.get();
        const std::string field = "\"model_sha256\":\"";
        const size_t at = head->find(field + placeholder + "\"");
        SPES_CHECK(at != std::string::npos && sha.size() == placeholder.size(),
                   "'{}': no digest placeholder in the first {} bytes of its header",
                   published_path(), head->size());
        head->replace(at + field.size(), sha.size(), sha);
      });
  // Downloads read it next, and it bypassed the page cache: start reading it back now.
  if (const int fd = ::open(published_path().c_str(), O_RDONLY); fd >= 0) {
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
    ::close(fd);
  }
  return sha;
}

void RoundStore::write_state(const PublishedRound& p, const std::string& sha,
                             const nlohmann::json& line) {
  nlohmann::json saved_line = line;
  if (saved_line.is_object()) saved_line["model_sha256"] = sha;
  const std::string format = format_name(kServerStateFormat, kServerStateFormatVersion);
  const nlohmann::json st = {{"format", format},
                             {"round", p.round},
                             {"step", p.step},
                             {"model_sha256", sha},
                             {"alpha", p.alpha},
                             {"merged", p.merged},
                             {"nodes", p.nodes},
                             {"mode", cfg_.spes_config.mode.name()},
                             {"model_fingerprint", model_.model_fingerprint()},
                             {"ownership_fingerprint", model_.ownership_fingerprint()},
                             {"server_incarnation", incarnation_},
                             {"line", saved_line},
                             {"time", unix_time()}};
  // The published file is the commit point (a restart resumes from it): from here on a
  // failure is logged, not thrown; state.json is written again with the next round.
  try {
    file_write_atomic(run_layout::server_state(dir_),
                      st.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } catch (const std::exception& e) {
    spdlog::error("round {} is published but '{}/state.json' could not be updated ({}); a "
                  "restart resumes from published.safetensors", p.round, dir_, e.what());
  }
}

void RoundStore::keep_round_copies(int64_t round, bool outer) {
  // Hard links: no copy on the way.
  fs::create_directories(run_layout::kept_round(dir_, round));
  auto keep = [&](const std::string& from, const std::string& as) {
    std::error_code ec;
    fs::remove(as, ec);
    fs::create_hard_link(from, as, ec);
    if (ec) fs::copy_file(from, as);
  };
  keep(published_path(), run_layout::kept_published(dir_, round));
  if (outer && round > 0) keep(momentum_path(round), run_layout::kept_momentum(dir_, round));
  // topk: the residual after this round (saved before the round was persisted), which
  // `spes aggregate --residual` needs to reproduce the next round.
  if (cfg_.spes_config.transfer.compression == Compression::Topk && fs::exists(residual_path()))
    keep(residual_path(), run_layout::kept_residual(dir_, round));
}

}  // namespace spes::sync
