// Trainer::change_ownership on a node of two data-parallel ranks (Gloo on loopback, one thread
// per rank around a TCPStore the test hosts, as the rank launcher does): both ranks change
// together, rank 0's handed moments reach rank 1 exactly, the ranks stay identical bit for bit
// and match one process over the same global batch (within 1e-6, fp32, as
// data_parallel_test.cpp); ranks handed different maps all refuse and stay as they were; a map
// change made by rank 0's sync client alone (Rank0Observer) reaches rank 1 at that step
// boundary, with its epoch and rank 0's handed moments, as if both ranks had changed together.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <map>
#include <thread>

#include "data/data_test_util.h"
#include "spes/common/error.h"
#include "spes/train/rank0_observer.h"
#include "spes/train/trainer.h"
#include "train/train_test_util.h"

using namespace spes;
using spes::test::TempDir;
using ::testing::HasSubstr;

namespace {

using Table = std::vector<std::vector<int64_t>>;
const Table kMapA = {{0, 0, 1, 1}, {0, 0, 1, 1}};
const Table kMapB = {{0, 1, 0, 1}, {0, 0, 0, 1}};
const std::vector<std::pair<int64_t, int64_t>> kGained = {{0, 2}, {1, 2}};

Config node_config(const std::string& shard, const Table& owners) {
  Config c = spes::test::tiny_train_config(shard, 20);
  c.precision = Precision::Fp32;
  c.spes_config.mode = SyncMode::Spes;
  c.spes_config.num_peers = 2;
  c.spes_config.expert_owners = owners;
  config_validate(c, "ownership change ranks test");
  return c;
}

TrainerOptions quiet(int64_t node, DistGroup* dist = nullptr) {
  TrainerOptions o;
  o.node_id = node;
  o.progress = ProgressMode::None;
  o.dist = dist;
  return o;
}

std::map<std::string, torch::Tensor> weights_of(const Trainer& t) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : t.registry().entries()) out[e.name] = e.tensor.detach().clone();
  return out;
}

std::map<std::string, torch::Tensor> moments_of(Trainer& t) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [n, v] : t.optimizer().state_tensors()) out[n] = v.clone();
  return out;
}

// Runs fn(rank, group) on two threads, each a rank of one Gloo group; returns each rank's error
// message ("" when it returned).
std::vector<std::string> on_two_ranks(const std::function<void(int, DistGroup&)>& fn) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.useLibUV = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const int port = store->getPort();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        DistGroup group(r, 2, "127.0.0.1", port, "gloo");
        fn(r, group);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST(OwnershipChangeRanks, TwoRanksChangeTogetherAndMatchOneProcess) {
  TempDir d;
  const std::string shard = spes::test::make_pattern_shard(d.path / "data", 20000, 64);
  const int64_t K = 2;
  ExpertMoments handed;
  {
    Trainer owner(node_config(shard, kMapA), d.file("owner"), quiet(1));
    for (int64_t i = 0; i < K; ++i) owner.train_step();
    handed = owner.expert_moments(kGained);
  }
  Trainer one(node_config(shard, kMapA), d.file("one"), quiet(0));
  for (int64_t i = 0; i < K; ++i) one.train_step();
  one.change_ownership(Ownership::from_table(2, kMapB), &handed);
  for (int64_t i = 0; i < K; ++i) one.train_step();

  std::vector<std::map<std::string, torch::Tensor>> w(2), m(2);
  std::vector<ExpertMoments> received(2);
  const auto errors = on_two_ranks([&](int r, DistGroup& g) {
    Trainer t(node_config(shard, kMapA), d.file("rank" + std::to_string(r)), quiet(0, &g));
    for (int64_t i = 0; i < K; ++i) t.train_step();
    t.change_ownership(Ownership::from_table(2, kMapB), r == 0 ? &handed : nullptr);
    received[r] = t.expert_moments(kGained);
    for (int64_t i = 0; i < K; ++i) t.train_step();
    w[r] = weights_of(t);
    m[r] = moments_of(t);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r)  // rank 1 was given nothing: rank 0's moments, exactly
    for (const auto& [n, e] : handed.by_name) {
      EXPECT_TRUE(torch::equal(received[r].by_name.at(n).exp_avg, e.exp_avg)) << r << " " << n;
      EXPECT_TRUE(torch::equal(received[r].by_name.at(n).exp_avg_sq, e.exp_avg_sq)) << n;
      EXPECT_EQ(received[r].by_name.at(n).step, e.step) << n;
    }
  const auto w1 = weights_of(one);
  ASSERT_EQ(w[0].size(), w1.size());
  for (const auto& [n, t] : w1) {
    EXPECT_TRUE(torch::equal(w[0].at(n), w[1].at(n))) << "the ranks differ: " << n;
    EXPECT_LE((w[0].at(n) - t).abs().max().item<double>(), 1e-6) << n;
  }
  const auto m1 = moments_of(one);
  ASSERT_EQ(m[0].size(), m1.size());
  for (const auto& [n, t] : m1) EXPECT_TRUE(torch::equal(m[0].at(n), m[1].at(n))) << n;
}

TEST(OwnershipChangeRanks, RanksGivenDifferentMapsAllRefuseAndStayAsTheyWere) {
  TempDir d;
  const std::string shard = spes::test::make_pattern_shard(d.path / "data", 20000, 64);
  std::vector<std::string> after(2);
  const auto errors = on_two_ranks([&](int r, DistGroup& g) {
    Trainer t(node_config(shard, kMapA), d.file("rank" + std::to_string(r)), quiet(0, &g));
    t.train_step();
    const Table mine = r == 0 ? kMapB : Table{{0, 1, 1, 0}, {0, 0, 0, 1}};
    try {
      t.change_ownership(Ownership::from_table(2, mine));
    } catch (const Error&) {
      after[r] = t.ownership().fingerprint();
      t.train_step();  // the ranks still pair up
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("were given different ownership maps")) << r;
    EXPECT_EQ(after[r], Ownership::from_table(2, kMapA).fingerprint()) << r;
  }
}

namespace {
// A sync client that, after step `at`, changes the node to `next` (epoch 1) with `handed`: what
// SyncNode does at a round boundary that brings a new map.
struct ChangeMapAfter : StepObserver {
  int64_t at;
  Ownership next;
  const ExpertMoments* handed;
  ChangeMapAfter(int64_t step, Ownership map, const ExpertMoments* moments)
      : at(step), next(std::move(map)), handed(moments) {}
  nlohmann::json after_step(Trainer& t, int64_t step) override {
    if (step == at) {
      t.change_ownership(next, handed);
      t.state().ownership_epoch = 1;
    }
    return {};
  }
};
}  // namespace

TEST(OwnershipChangeRanks, AMapChangedByRank0sSyncClientReachesEveryRank) {
  TempDir d;
  const std::string shard = spes::test::make_pattern_shard(d.path / "data", 20000, 64);
  const int64_t K = 2, total = 20;
  ExpertMoments handed;
  {
    Trainer owner(node_config(shard, kMapA), d.file("owner"), quiet(1));
    for (int64_t i = 0; i < K; ++i) owner.train_step();
    handed = owner.expert_moments(kGained);
  }
  // Reference: both ranks change together after step K (the collective path tested above).
  std::vector<std::map<std::string, torch::Tensor>> w_ref(2), m_ref(2);
  auto errors = on_two_ranks([&](int r, DistGroup& g) {
    Trainer t(node_config(shard, kMapA), d.file("ref" + std::to_string(r)), quiet(0, &g));
    for (int64_t i = 0; i < K; ++i) t.train_step();
    t.change_ownership(Ownership::from_table(2, kMapB), r == 0 ? &handed : nullptr);
    for (int64_t i = K; i < total; ++i) t.train_step();
    w_ref[r] = weights_of(t);
    m_ref[r] = moments_of(t);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  // Rank 0's client alone changes the map after step K; run() with Rank0Observer on both.
  std::vector<std::map<std::string, torch::Tensor>> w(2), m(2);
  std::vector<std::string> map(2);
  std::vector<int64_t> epoch(2, -1);
  errors = on_two_ranks([&](int r, DistGroup& g) {
    ChangeMapAfter client(K, Ownership::from_table(2, kMapB), &handed);
    Rank0Observer ranks(g, &client);
    TrainerOptions o = quiet(0, &g);
    o.observer = &ranks;
    Trainer t(node_config(shard, kMapA), d.file("obs" + std::to_string(r)), o);
    t.run();
    w[r] = weights_of(t);
    m[r] = moments_of(t);
    map[r] = t.ownership().fingerprint();
    epoch[r] = t.state().ownership_epoch;
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(map[r], Ownership::from_table(2, kMapB).fingerprint()) << "rank " << r;
    EXPECT_EQ(epoch[r], 1) << "rank " << r;
  }
  ASSERT_EQ(w[1].size(), w_ref[0].size());
  for (const auto& [n, ref] : w_ref[0]) {
    EXPECT_TRUE(torch::equal(w[0].at(n), w[1].at(n))) << "the ranks differ: " << n;
    EXPECT_TRUE(torch::equal(w[1].at(n), ref)) << "not as if both had changed together: " << n;
  }
  ASSERT_EQ(m[1].size(), m_ref[0].size());
  for (const auto& [n, ref] : m_ref[0]) {
    EXPECT_TRUE(torch::equal(m[0].at(n), m[1].at(n))) << "the ranks' moments differ: " << n;
    EXPECT_TRUE(torch::equal(m[1].at(n), ref)) << n;
  }
}
