// Tests of BatchLoader over a synthetic corpus whose token ids equal their positions, so each
// window identifies itself: targets, determinism, per-node seeds, the strided split across
// nodes, the validation split, epochs, exact resume and the errors for too little data.
#include <gtest/gtest.h>

#include <set>

#include "data/data_test_util.h"
#include "spes/common/error.h"
#include "spes/data/loader.h"

namespace {
using spes::Batch;
using spes::BatchLoader;
using spes::Split;

constexpr int64_t T = 8;

struct Corpus {
  spes::test::TempDir dir;
  std::string path;
  explicit Corpus(int64_t n, uint32_t first = 0, const std::string& name = "c.bin") {
    std::vector<uint32_t> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = first + static_cast<uint32_t>(i);
    path = dir.file(name);
    spes::test::write_bytes(path, spes::test::le_bytes(v));
  }
};

spes::DataConfig config(const std::string& path, double fraction = 0.1) {
  spes::DataConfig d;
  d.paths = {path};
  d.validation_fraction = fraction;
  return d;
}

// Window indices of a batch, checking the window's content and targets on the way.
std::vector<int64_t> windows(const Batch& b, int64_t first_token = 0) {
  EXPECT_EQ(b.tokens.dtype(), torch::kInt64);
  EXPECT_EQ(b.tokens.sizes(), b.targets.sizes());
  std::vector<int64_t> w;
  auto tok = b.tokens.accessor<int64_t, 2>();
  auto tgt = b.targets.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b.tokens.size(0); ++r) {
    const int64_t start = tok[r][0] - first_token;
    EXPECT_EQ(start % T, 0);
    for (int64_t i = 0; i < T; ++i) {
      EXPECT_EQ(tok[r][i], tok[r][0] + i);
      EXPECT_EQ(tgt[r][i], i + 1 < T ? tok[r][i + 1] : -1);
    }
    w.push_back(start / T);
  }
  return w;
}

std::vector<int64_t> take(BatchLoader& l, int64_t batches, int64_t bs) {
  std::vector<int64_t> all;
  for (int64_t i = 0; i < batches; ++i) {
    auto w = windows(l.next(bs));
    all.insert(all.end(), w.begin(), w.end());
  }
  return all;
}

TEST(BatchLoader, DeterministicPermutationPerEpoch) {
  Corpus c(100 * T + 5);  // 100 windows (tail of 5 dropped): 10 validation, 90 train
  BatchLoader a(config(c.path), T, 1234, 0, 1, Split::Train);
  BatchLoader b(config(c.path), T, 1234, 0, 1, Split::Train);
  EXPECT_EQ(a.num_windows(), 90);
  EXPECT_EQ(a.total_tokens(), 100 * T + 5);
  EXPECT_EQ(a.vocab_size_hint(), -1);
  const auto e0 = take(a, 9, 10);
  EXPECT_EQ(e0, take(b, 9, 10));
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), 90u);  // each window once
  EXPECT_LT(*std::max_element(e0.begin(), e0.end()), 90);
  EXPECT_EQ(a.state().epoch, 0);
  EXPECT_EQ(a.state().position, 90);
  const auto e1 = take(a, 9, 10);  // epoch 1: a new order of the same windows
  EXPECT_EQ(a.state().epoch, 1);
  EXPECT_EQ(std::set<int64_t>(e1.begin(), e1.end()), std::set<int64_t>(e0.begin(), e0.end()));
  EXPECT_NE(e1, e0);
  // Fixed values: the order is specified (seed_seq + mt19937_64 + own Fisher-Yates), so it must
  // not change across platforms or library versions.
  EXPECT_EQ(std::vector<int64_t>(e0.begin(), e0.begin() + 6),
            (std::vector<int64_t>{66, 2, 53, 55, 26, 74}));
}

TEST(BatchLoader, NodesUseDifferentSeeds) {
  Corpus c(100 * T);
  BatchLoader n0(config(c.path), T, 1234, 0, 4, Split::Train);
  BatchLoader n1(config(c.path), T, 1234, 1, 4, Split::Train);
  EXPECT_EQ(n1.num_windows(), 90);  // every node sees the whole train set
  EXPECT_NE(take(n0, 3, 10), take(n1, 3, 10));
  BatchLoader other_seed(config(c.path), T, 1235, 0, 4, Split::Train);
  BatchLoader n0_again(config(c.path), T, 1234, 0, 4, Split::Train);
  EXPECT_NE(take(other_seed, 3, 10), take(n0_again, 3, 10));
}

// data.seed (OLMo's meaning): the node's data-order seed as written, not offset again by the
// node id; without it node i follows seed + 1000 i (which is what the reference's node YAMLs
// write out: data.seed 7198 for node 1 of seed 6198).
TEST(BatchLoader, DataSeedIsTheNodesOrderSeedAsWritten) {
  Corpus c(100 * T);
  spes::DataConfig with = config(c.path);
  with.seed = 7198;
  BatchLoader node1_default(config(c.path), T, 6198, 1, 4, Split::Train);
  BatchLoader node1_written(with, T, 6198, 1, 4, Split::Train);
  EXPECT_EQ(take(node1_written, 3, 10), take(node1_default, 3, 10));
  BatchLoader node2_written(with, T, 6198, 2, 4, Split::Train);  // 7198 again, not 9198
  BatchLoader node1_again(config(c.path), T, 6198, 1, 4, Split::Train);
  EXPECT_EQ(take(node2_written, 3, 10), take(node1_again, 3, 10));
  BatchLoader node2_default(config(c.path), T, 6198, 2, 4, Split::Train);
  BatchLoader node1_third(config(c.path), T, 6198, 1, 4, Split::Train);
  EXPECT_NE(take(node2_default, 3, 10), take(node1_third, 3, 10));
}

TEST(BatchLoader, SplitAcrossNodesIsDisjointAndCovers) {
  Corpus c(100 * T);
  auto d = config(c.path);
  d.split_across_nodes = true;
  std::multiset<int64_t> seen;
  int64_t total = 0;
  for (int64_t node = 0; node < 4; ++node) {
    BatchLoader l(d, T, 99, node, 4, Split::Train);
    EXPECT_EQ(l.num_windows(), node < 2 ? 23 : 22);  // 90 = 23 + 23 + 22 + 22
    auto w = take(l, 1, l.num_windows());
    seen.insert(w.begin(), w.end());
    total += l.num_windows();
  }
  EXPECT_EQ(total, 90);
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 90u);  // disjoint
  EXPECT_EQ(*seen.rbegin(), 89);                                        // train windows only
}

TEST(BatchLoader, ValidationIsTheTailInFixedOrder) {
  Corpus c(100 * T + 3);
  BatchLoader v(config(c.path), T, 1, 0, 1, Split::Validation);
  EXPECT_EQ(v.num_windows(), 10);
  EXPECT_EQ(take(v, 1, 4), (std::vector<int64_t>{90, 91, 92, 93}));
  EXPECT_EQ(take(v, 1, 8), (std::vector<int64_t>{94, 95, 96, 97, 98, 99, 90, 91}));  // wraps
  v.reset();
  EXPECT_EQ(take(v, 1, 2), (std::vector<int64_t>{90, 91}));
  // The fraction rounds up and keeps at least one window.
  EXPECT_EQ(BatchLoader(config(c.path, 0.001), T, 1, 0, 1, Split::Validation).num_windows(), 1);
  EXPECT_EQ(BatchLoader(config(c.path, 0.01), T, 1, 0, 1, Split::Train).num_windows(), 99);
  EXPECT_EQ(BatchLoader(config(c.path, 0.0), T, 1, 0, 1, Split::Train).num_windows(), 100);
}

TEST(BatchLoader, ExplicitValidationFiles) {
  Corpus train(50 * T), val(7 * T + 1, 1000000, "v.bin");
  auto d = config(train.path, 0.5);
  d.validation_paths = {val.path};
  BatchLoader t(d, T, 1, 0, 1, Split::Train);
  EXPECT_EQ(t.num_windows(), 50);  // all of data.paths trains
  BatchLoader v(d, T, 1, 0, 1, Split::Validation);
  EXPECT_EQ(v.num_windows(), 7);
  EXPECT_EQ(windows(v.next(7), 1000000), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
}

TEST(BatchLoader, StateRestoreResumesExactly) {
  Corpus c(100 * T);
  for (int64_t before : {0, 5, 12, 13}) {  // 13 * 7 = 91 windows: crosses the epoch boundary
    BatchLoader a(config(c.path), T, 77, 1, 2, Split::Train);
    take(a, before, 7);
    const spes::LoaderState s = a.state();
    const auto expect = take(a, 20, 7);
    BatchLoader b(config(c.path), T, 77, 1, 2, Split::Train);
    take(b, 3, 5);  // a different position first: restore must override it
    b.restore(s);
    EXPECT_EQ(take(b, 20, 7), expect) << "restored after " << before << " batches";
  }
  BatchLoader a(config(c.path), T, 77, 0, 1, Split::Train);
  EXPECT_THROW(a.restore({0, 91}), spes::Error);
}

TEST(BatchLoader, ClearErrorsForTooLittleData) {
  auto msg = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const spes::Error& e) {
      return e.what();
    }
    return "no error";
  };
  Corpus tiny(5);
  std::string m = msg([&] { BatchLoader(config(tiny.path), T, 1, 0, 1, Split::Train); });
  EXPECT_NE(m.find("5 tokens"), std::string::npos) << m;
  EXPECT_NE(m.find("at least 8 tokens"), std::string::npos) << m;
  Corpus one(T);
  m = msg([&] { BatchLoader(config(one.path, 0.5), T, 1, 0, 1, Split::Train); });
  EXPECT_NE(m.find("leaves none for training"), std::string::npos) << m;
  m = msg([&] { BatchLoader(config(one.path, 0.0), T, 1, 0, 1, Split::Validation); });
  EXPECT_NE(m.find("no validation data"), std::string::npos) << m;
  Corpus few(4 * T);
  auto d = config(few.path, 0.0);
  d.split_across_nodes = true;
  m = msg([&] { BatchLoader(d, T, 1, 5, 6, Split::Train); });
  EXPECT_NE(m.find("leave none for node 5 of 6"), std::string::npos) << m;
  EXPECT_THROW(BatchLoader(config(few.path), T, 1, 2, 2, Split::Train), spes::Error);
}

}  // namespace
