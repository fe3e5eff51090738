// The server's ownership epochs on disk (see ownership_epochs.h).
#include "spes/sync/server/ownership_epochs.h"

#include <spdlog/spdlog.h>

#include <filesystem>

#include "spes/common/error.h"
#include "spes/io/run_layout.h"
#include "spes/io/files.h"
#include "spes/sync/round/ownership_map.h"

namespace spes::sync {

namespace {
constexpr const char* kFormat = kOwnershipFileFormat;
}

OwnershipEpochs::OwnershipEpochs(std::string dir, const Ownership& initial, int64_t max_nodes)
    : dir_(std::move(dir)), max_nodes_(max_nodes) {
  epochs_.push_back(ownership_map(initial, 0, 1));
  handoffs_.push_back(nlohmann::json::array());
}

std::string OwnershipEpochs::path() const { return run_layout::ownership_epochs(dir_); }

void OwnershipEpochs::start() {
  epochs_.resize(1);
  handoffs_.resize(1);
  save();
}

void OwnershipEpochs::resume(int64_t published_round) {
  if (!std::filesystem::exists(path())) {
    spdlog::warn("sync server: '{}' is missing (a directory of an older server, or it was "
                 "removed): the run continues with the config's map (ownership epoch 0)",
                 path());
    start();
    return;
  }
  const OwnershipMap initial = epochs_.front();
  std::vector<OwnershipMap> loaded;
  std::vector<nlohmann::json> handoffs;
  try {
    const nlohmann::json j = nlohmann::json::parse(file_read(path()));
    SPES_CHECK(j.value("format", "") == kFormat, "format '{}', expected '{}'",
               j.value("format", ""), kFormat);
    for (const auto& e : j.at("epochs")) {
      OwnershipMap m = ownership_map_from_json(e.at("map"));
      // Only epochs whose introducing round was published (it starts at or before the
      // collecting round) count; a later one was saved by a server that died before
      // publishing its round.
      if (m.from_round > published_round + 1) continue;
      SPES_CHECK(static_cast<int64_t>(loaded.size()) == m.epoch, "epoch {} out of order", m.epoch);
      // The map must be what it says it is (its owners in range, its fingerprint).
      (void)ownership_of(m, max_nodes_, static_cast<int64_t>(initial.table.size()),
                         initial.table.empty() ? 0 : static_cast<int64_t>(initial.table[0].size()),
                         path());
      handoffs.push_back(e.value("handoffs", nlohmann::json::array()));
      loaded.push_back(std::move(m));
    }
  } catch (const std::exception& e) {
    fail("'{}' is damaged ({}); restore it, or start over with --overwrite", path(), e.what());
  }
  SPES_CHECK(!loaded.empty() && loaded[0].fingerprint == initial.fingerprint,
             "'{}' starts from another ownership map ({}) than the config's ({}): it belongs "
             "to another run; use the same config, another --out, or --overwrite", path(),
             loaded.empty() ? "none" : loaded[0].fingerprint, initial.fingerprint);
  epochs_ = std::move(loaded);
  handoffs_ = std::move(handoffs);
  save();  // drops the epochs of rounds that were never published
  if (epochs_.size() > 1)
    spdlog::info("sync server: ownership epoch {} (from round {}, map {})", latest().epoch,
                 latest().from_round, latest().fingerprint);
}

const OwnershipMap& OwnershipEpochs::at_round(int64_t round) const {
  for (size_t i = epochs_.size(); i-- > 0;)
    if (epochs_[i].from_round <= round) return epochs_[i];
  return epochs_.front();
}

void OwnershipEpochs::introduce(const OwnershipMap& next, const nlohmann::json& handoffs) {
  std::vector<OwnershipMap> epochs = epochs_;
  std::vector<nlohmann::json> moved = handoffs_;
  if (epochs.size() > 1 && epochs.back().from_round >= next.from_round) {
    epochs.pop_back();  // a retried save of the same round's decision
    moved.pop_back();
  }
  SPES_CHECK(next.epoch == epochs.back().epoch + 1 && next.from_round > epochs.back().from_round,
             "ownership epoch {} from round {} does not follow epoch {} from round {}",
             next.epoch, next.from_round, epochs.back().epoch, epochs.back().from_round);
  epochs.push_back(next);
  moved.push_back(handoffs);
  std::swap(epochs, epochs_);
  std::swap(moved, handoffs_);
  try {
    save();
  } catch (...) {
    std::swap(epochs, epochs_);
    std::swap(moved, handoffs_);
    throw;
  }
}

nlohmann::json OwnershipEpochs::handoffs(int64_t epoch) const {
  if (epoch < 0 || epoch >= static_cast<int64_t>(handoffs_.size())) return nlohmann::json::array();
  return handoffs_[static_cast<size_t>(epoch)];
}

bool OwnershipEpochs::knows(int64_t epoch, const std::string& fingerprint) const {
  if (epoch < 0 || epoch >= static_cast<int64_t>(epochs_.size())) return false;
  return fingerprint.empty() || epochs_[static_cast<size_t>(epoch)].fingerprint == fingerprint;
}

void OwnershipEpochs::save() const {
  nlohmann::json list = nlohmann::json::array();
  for (size_t i = 0; i < epochs_.size(); ++i)
    list.push_back({{"map", ownership_map_json(epochs_[i])}, {"handoffs", handoffs_[i]}});
  file_write_atomic(path(), nlohmann::json{{"format", kFormat}, {"epochs", list}}.dump(1));
}

}  // namespace spes::sync
