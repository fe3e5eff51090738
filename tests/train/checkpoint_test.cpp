// Checkpoints on a tiny model: save/load round trip (weights, AdamW moments, state fields,
// config), no temporary directories left behind, corruption and truncation detected by the
// checksums, and a failed load never leaves the model half-overwritten.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/io/format_version.h"
#include "spes/model/losses.h"
#include "spes/train/checkpoint.h"
#include "train/train_test_util.h"

using namespace spes;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

// The trainer tests' tiny MoE config (train_test_util.h; its data is never read here).
Config tiny_config() {
  Config c = spes::test::tiny_train_config("unused.bin", 1);
  c.run_name = "ckpt-test";
  return c;
}

// A model with its registry and optimizer (centralized: everything trainable).
struct Node {
  Config cfg;
  Transformer model;
  Ownership own;
  ParamRegistry reg;
  AdamW opt;
  Node(const Config& c, uint64_t seed)
      : cfg(c), model(c.model), own(Ownership::from_config(c)), reg(model, c, own, 0),
        opt(reg.trainable(), c.optimizer) {
    model.init_weights(seed);
  }
  void train_step(uint64_t seed) {
    torch::manual_seed(seed);
    torch::Tensor tokens = torch::randint(0, cfg.model.vocab_size, {2, 8}, torch::kInt64);
    torch::Tensor targets = torch::full({2, 8}, -1, torch::kInt64);
    targets.narrow(1, 0, 7).copy_(tokens.narrow(1, 1, 7));
    compute_losses(model, tokens, targets).total.backward();
    opt.step(1e-2, 1.0);
    opt.zero_grad();
  }
  NamedTensors moments() const {
    NamedTensors out;
    for (const auto& [n, t] : opt.state_tensors()) out.emplace_back(n, t.clone());
    return out;
  }
};

class CheckpointFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() /
            ("spes_ckpt_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    fs::create_directories(base_);
  }
  void TearDown() override { fs::remove_all(base_); }

  std::set<std::string> listing(const fs::path& dir) const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
    return out;
  }
  // A copy of checkpoint `src` to damage.
  std::string copy_of(const std::string& src, const std::string& name) const {
    const std::string dst = (base_ / name).string();
    fs::copy(src, dst, fs::copy_options::recursive);
    return dst;
  }
  static void flip_byte(const std::string& path, size_t from_end) {
    std::string b = file_read(path);
    b[b.size() - 1 - from_end] ^= 0x01;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << b;
  }
  static std::string load_error(const std::string& dir, Node& n, bool with_opt) {
    try {
      checkpoint_load(dir, n.reg, with_opt ? &n.opt : nullptr);
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  }

  fs::path base_;
};

TrainState sample_state() {
  TrainState s;
  s.step = 7;
  s.tokens = 1234567;
  s.loader.epoch = 2;
  s.loader.position = 35;
  s.sync_round = 3;
  s.extra = {{"client", {{"round", 3}, {"ids", {1, 2}}}}};
  return s;
}

}  // namespace

TEST_F(CheckpointFiles, RoundTrip) {
  Config cfg = tiny_config();
  Node a(cfg, 1);
  a.train_step(10);
  a.train_step(11);
  const std::string dir = (base_ / "ckpt").string();
  checkpoint_save(dir, cfg, a.reg, &a.opt, sample_state());

  EXPECT_EQ(listing(base_), (std::set<std::string>{"ckpt"}));  // no *.tmp.* or *.old
  EXPECT_EQ(listing(dir), (std::set<std::string>{"model.safetensors", "optimizer.safetensors",
                                                 "config.yaml", "state.json"}));

  Node b(cfg, 2);
  ASSERT_NE(b.reg.weights_sha256(), a.reg.weights_sha256());
  TrainState s = checkpoint_load(dir, b.reg, &b.opt);
  EXPECT_EQ(b.reg.weights_sha256(), a.reg.weights_sha256());
  for (size_t i = 0; i < a.reg.entries().size(); ++i)
    EXPECT_TRUE(torch::equal(a.reg.entries()[i].tensor, b.reg.entries()[i].tensor))
        << a.reg.entries()[i].name;
  NamedTensors ma = a.moments(), mb = b.moments();
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i].first, mb[i].first);
    EXPECT_TRUE(torch::equal(ma[i].second, mb[i].second)) << ma[i].first;
  }
  EXPECT_GT(ma[0].second.abs().sum().item<double>(), 0.0);
  EXPECT_EQ(b.opt.step_count(), 2);
  const TrainState want = sample_state();
  EXPECT_EQ(s.step, want.step);
  EXPECT_EQ(s.tokens, want.tokens);
  EXPECT_EQ(s.loader.epoch, want.loader.epoch);
  EXPECT_EQ(s.loader.position, want.loader.position);
  EXPECT_EQ(s.sync_round, want.sync_round);
  EXPECT_EQ(s.extra, want.extra);
  Config back = checkpoint_config(dir);
  EXPECT_EQ(config_to_yaml(back), config_to_yaml(cfg));

  // Both continue identically.
  a.train_step(12);
  b.train_step(12);
  EXPECT_EQ(b.reg.weights_sha256(), a.reg.weights_sha256());

  // Saving again over the same directory replaces it and leaves nothing else behind.
  checkpoint_save(dir, cfg, a.reg, &a.opt, sample_state());
  EXPECT_EQ(listing(base_), (std::set<std::string>{"ckpt"}));
  Node c(cfg, 3);
  checkpoint_load(dir, c.reg, nullptr);  // weights only
  EXPECT_EQ(c.reg.weights_sha256(), a.reg.weights_sha256());
  EXPECT_EQ(c.opt.step_count(), 0);
}

TEST_F(CheckpointFiles, CorruptionAndTruncationDetectedWeightsUnchanged) {
  Config cfg = tiny_config();
  Node a(cfg, 1);
  a.train_step(10);
  const std::string dir = (base_ / "ckpt").string();
  checkpoint_save(dir, cfg, a.reg, &a.opt, sample_state());

  Node fresh(cfg, 5);
  const std::string sha = fresh.reg.weights_sha256();
  const NamedTensors mom = fresh.moments();
  auto unchanged = [&]() {
    EXPECT_EQ(fresh.reg.weights_sha256(), sha) << "the model was modified by a failed load";
    NamedTensors now = fresh.moments();
    for (size_t i = 0; i < mom.size(); ++i)
      EXPECT_TRUE(torch::equal(now[i].second, mom[i].second)) << "optimizer moment " << mom[i].first;
    EXPECT_EQ(fresh.opt.step_count(), 0);
  };

  // One flipped byte in the weights (inside the data section) -> checksum error.
  const std::string d1 = copy_of(dir, "corrupt");
  flip_byte(d1 + "/model.safetensors", 5);
  EXPECT_THAT(load_error(d1, fresh, true), HasSubstr("checksum"));
  EXPECT_THAT(load_error(d1, fresh, true), HasSubstr("model.safetensors"));
  unchanged();

  // Truncated weights file.
  const std::string d2 = copy_of(dir, "truncated");
  {
    std::string b = file_read(d2 + "/model.safetensors");
    std::ofstream(d2 + "/model.safetensors", std::ios::binary | std::ios::trunc)
        << b.substr(0, b.size() / 2);
  }
  EXPECT_THAT(load_error(d2, fresh, true), HasSubstr("truncated"));
  unchanged();

  // Missing or corrupt state.json.
  const std::string d3 = copy_of(dir, "nostate");
  fs::remove(d3 + "/state.json");
  EXPECT_THAT(load_error(d3, fresh, true), HasSubstr("no state.json"));
  const std::string d4 = copy_of(dir, "badstate");
  std::ofstream(d4 + "/state.json", std::ios::trunc) << "{\"step\": ";
  EXPECT_THAT(load_error(d4, fresh, true), HasSubstr("state.json"));
  unchanged();

  // A checkpoint of another architecture.
  Config other = cfg;
  other.model.mlp_hidden_size = 20;
  Node o(other, 1);
  const std::string d5 = (base_ / "other").string();
  checkpoint_save(d5, other, o.reg, &o.opt, sample_state());
  EXPECT_THAT(load_error(d5, fresh, true), HasSubstr("shape"));
  unchanged();
}

// A load that fails on the optimizer part must not have overwritten the weights already.
// LIBRARY BUG (reported): checkpoint_load (checkpoint.cpp) copies the weights into the registry
// before it reads and verifies optimizer.safetensors (and before it reads the state fields), so
// a corrupt optimizer file, a weights-only checkpoint loaded for resume, or a state.json lacking
// "step" leaves the model with the checkpoint's weights but the caller's old optimizer state.
// Fix: read, verify and parse every file and field first; copy into the model and optimizer only
// when everything has been validated.
TEST_F(CheckpointFiles, FailedOptimizerLoadLeavesWeightsUnchanged) {
  Config cfg = tiny_config();
  Node a(cfg, 1);
  a.train_step(10);
  const std::string dir = (base_ / "ckpt").string();
  checkpoint_save(dir, cfg, a.reg, &a.opt, sample_state());
  const std::string weights_only = (base_ / "weights").string();
  checkpoint_save(weights_only, cfg, a.reg, nullptr, sample_state());

  Node fresh(cfg, 5);
  const std::string sha = fresh.reg.weights_sha256();

  const std::string d1 = copy_of(dir, "corrupt_opt");
  flip_byte(d1 + "/optimizer.safetensors", 3);
  EXPECT_THAT(load_error(d1, fresh, true), HasSubstr("checksum"));
  EXPECT_EQ(fresh.reg.weights_sha256(), sha) << "corrupt optimizer.safetensors";

  EXPECT_THAT(load_error(weights_only, fresh, true), HasSubstr("no optimizer state"));
  EXPECT_EQ(fresh.reg.weights_sha256(), sha) << "weights-only checkpoint loaded for resume";
}

// The version rule (io/format_version.h): a checkpoint of a newer format is refused with both
// versions and the fix before anything is loaded; one of another family or without a format
// is not taken for a checkpoint.
TEST_F(CheckpointFiles, NewerFormatIsRefusedNamingBothVersions) {
  Config cfg = tiny_config();
  Node a(cfg, 1);
  const std::string dir = (base_ / "ckpt").string();
  checkpoint_save(dir, cfg, a.reg, &a.opt, sample_state());
  auto with_format = [&](const std::string& name, const nlohmann::json& format) {
    const std::string d = copy_of(dir, name);
    nlohmann::json st = nlohmann::json::parse(file_read(d + "/state.json"));
    if (format.is_null()) st.erase("format");
    else st["format"] = format;
    file_write_atomic(d + "/state.json", st.dump());
    return d;
  };
  Node b(cfg, 2);
  const std::string before = b.reg.weights_sha256();
  const std::string newer = with_format("newer", "spes-checkpoint-v" +
                                                     std::to_string(kCheckpointFormatVersion + 1));
  EXPECT_THAT(load_error(newer, b, true),
              HasSubstr("by a newer spes; this spes reads spes-checkpoint up to version " +
                        std::to_string(kCheckpointFormatVersion)));
  EXPECT_THAT(load_error(with_format("other", "spes-server-state-v1"), b, true),
              HasSubstr("is not spes-checkpoint-v<N>"));
  EXPECT_THAT(load_error(with_format("none", nullptr), b, true), HasSubstr("names no format"));
  EXPECT_EQ(b.reg.weights_sha256(), before);
  EXPECT_NO_THROW(checkpoint_load(dir, b.reg, &b.opt));
}

TEST(FormatVersion, ReadsEveryVersionUpToItsOwnAndNamesTheFamily) {
  EXPECT_EQ(format_name("spes-x", 3), "spes-x-v3");
  EXPECT_EQ(format_version("spes-x-v1", "spes-x", 3, "f"), 1);
  EXPECT_EQ(format_version("spes-x-v3", "spes-x", 3, "f"), 3);
  for (const char* bad : {"spes-x-v0", "spes-x-v", "spes-x-v1a", "spes-y-v1", "spes-x-v-1", ""})
    EXPECT_THROW(format_version(bad, "spes-x", 3, "f"), Error) << bad;
  try {
    format_version("spes-x-v4", "spes-x", 3, "dir/state.json");
    ADD_FAILURE() << "a newer version was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("dir/state.json: written in format spes-x-v4 by a newer spes"));
    EXPECT_THAT(e.what(), HasSubstr("up to version 3"));
  }
}
