// BatchLoader (see loader.h). Windows are numbered over the concatenation of all shards:
// window w = tokens [w*T, (w+1)*T). Without data.validation_paths the last
// ceil(validation_fraction * W) windows (at least one when the fraction is > 0) are validation.
// Train order per epoch: Fisher-Yates over the train windows driven by std::mt19937_64 seeded
// through std::seed_seq (both fully specified by the C++ standard, unlike std::shuffle and the
// distributions), so every platform visits the same windows. Leaves out: document-aware packing
// and attention masks across document boundaries (EOS tokens separate documents).
#include "spes/data/loader.h"

#include <cmath>
#include <random>

#include "spes/common/error.h"
#include "spes/data/token_corpus.h"

namespace spes {
namespace {

std::mt19937_64 make_rng(int64_t seed, int64_t epoch) {
  const uint64_t s = static_cast<uint64_t>(seed), e = static_cast<uint64_t>(epoch);
  std::seed_seq seq{uint32_t(s), uint32_t(s >> 32), uint32_t(e), uint32_t(e >> 32)};
  return std::mt19937_64(seq);
}

// Uniform in [0, bound) by rejection (no modulo bias); bound > 0.
uint64_t uniform_below(std::mt19937_64& g, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  uint64_t x;
  do {
    x = g();
  } while (x < threshold);
  return x % bound;
}

std::vector<int64_t> permutation(int64_t n, int64_t seed, int64_t epoch) {
  std::vector<int64_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  auto g = make_rng(seed, epoch);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[uniform_below(g, uint64_t(i) + 1)]);
  return p;
}

}  // namespace

struct BatchLoader::Impl {
  std::unique_ptr<TokenCorpus> corpus;
  int64_t vocab_hint = -1;
  int64_t T = 0;
  Split split = Split::Train;
  int64_t first_window = 0;  // corpus window index of this split's window 0
  int64_t split_windows = 0;  // windows in this split (all nodes)
  int64_t seed = 0, node_id = 0, num_nodes = 1;
  bool across_nodes = false;
  int64_t per_epoch = 0;  // windows this loader visits per epoch
  std::vector<int64_t> order;  // train: this epoch's windows (split-relative), for this node
  LoaderState st;

  int64_t data_seed = -1;  // data.seed: the order's seed as written (-1: from seed)

  void build_order(int64_t epoch) {
    if (split != Split::Train) return;
    if (across_nodes) {  // one permutation for all nodes (data.seed must then be the same)
      std::vector<int64_t> p =
          permutation(split_windows, data_seed >= 0 ? data_seed : seed, epoch);
      order.clear();
      for (int64_t i = node_id; i < split_windows; i += num_nodes) order.push_back(p[i]);
    } else {
      order = permutation(split_windows, data_seed >= 0 ? data_seed : seed + 1000 * node_id,
                          epoch);
    }
  }
};

BatchLoader::BatchLoader(const DataConfig& data, int64_t seq_len, int64_t seed, int64_t node_id,
                         int64_t num_nodes, Split split)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  SPES_CHECK(seq_len >= 2, "sequence length {} is too short (need at least 2 tokens)", seq_len);
  SPES_CHECK(num_nodes >= 1 && node_id >= 0 && node_id < num_nodes,
             "node id {} is outside [0, {})", node_id, num_nodes);
  SPES_CHECK(data.validation_fraction >= 0 && data.validation_fraction < 1,
             "data.validation_fraction is {}, expected a value in [0, 1)",
             data.validation_fraction);
  m.T = seq_len;
  m.split = split;
  m.seed = seed;
  m.data_seed = data.seed;
  m.node_id = node_id;
  m.num_nodes = num_nodes;
  m.across_nodes = data.split_across_nodes;

  const bool explicit_val = !data.validation_paths.empty();
  const bool use_val_files = explicit_val && split == Split::Validation;
  if (use_val_files) {
    // Validation ids are checked against the training data's vocabulary when it is known.
    int64_t train_vocab = TokenCorpus(data.paths).vocab_size();
    m.corpus = std::make_unique<TokenCorpus>(data.validation_paths, train_vocab);
    m.vocab_hint = train_vocab;
  } else {
    m.corpus = std::make_unique<TokenCorpus>(data.paths);
    m.vocab_hint = m.corpus->vocab_size();
  }
  const int64_t N = m.corpus->total_tokens(), W = N / seq_len;
  const std::string what = use_val_files ? "data.validation_paths" : "data.paths";
  SPES_CHECK(W >= 1, "{} hold {} tokens, fewer than one window of {} tokens (seq_len); need at "
             "least {} tokens", what, N, seq_len, seq_len);

  if (explicit_val) {
    m.first_window = 0;
    m.split_windows = W;
  } else {
    const double f = data.validation_fraction;
    const int64_t n_val =
        f > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(f * W - 1e-9))) : 0;
    if (split == Split::Validation) {
      SPES_CHECK(n_val > 0, "no validation data: data.validation_fraction is 0 and "
                 "data.validation_paths is empty; set one of them");
      m.first_window = W - n_val;
      m.split_windows = n_val;
    } else {
      SPES_CHECK(W - n_val >= 1, "data.paths hold {} tokens = {} windows of {}; the validation "
                 "split (fraction {}) takes {} of them and leaves none for training; need at "
                 "least {} tokens or a smaller data.validation_fraction", N, W, seq_len, f, n_val,
                 (n_val + 1) * seq_len);
      m.first_window = 0;
      m.split_windows = W - n_val;
    }
  }

  if (split == Split::Train && m.across_nodes) {
    m.per_epoch = (m.split_windows - node_id + num_nodes - 1) / num_nodes;
    SPES_CHECK(m.per_epoch >= 1, "data.split_across_nodes: the {} training windows of {} tokens "
               "leave none for node {} of {}; need at least {} tokens", m.split_windows, seq_len,
               node_id, num_nodes, num_nodes * seq_len);
  } else {
    m.per_epoch = m.split_windows;
  }
  m.build_order(0);
}

BatchLoader::~BatchLoader() = default;
BatchLoader::BatchLoader(BatchLoader&&) noexcept = default;

Batch BatchLoader::next(int64_t batch_size) {
  Impl& m = *impl_;
  SPES_CHECK(batch_size >= 1, "batch size {} must be at least 1", batch_size);
  const int64_t T = m.T;
  torch::Tensor tokens = torch::empty({batch_size, T}, torch::kInt64);
  torch::Tensor targets = torch::empty({batch_size, T}, torch::kInt64);
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* gp = targets.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_size; ++b) {
    if (m.st.position >= m.per_epoch) {
      ++m.st.epoch;
      m.st.position = 0;
      m.build_order(m.st.epoch);
    }
    const int64_t local = m.split == Split::Train ? m.order[m.st.position] : m.st.position;
    m.corpus->read((m.first_window + local) * T, T, tp + b * T);
    ++m.st.position;
    std::copy(tp + b * T + 1, tp + (b + 1) * T, gp + b * T);
    gp[(b + 1) * T - 1] = -1;
  }
  return {tokens, targets};
}

LoaderState BatchLoader::state() const { return impl_->st; }

void BatchLoader::restore(const LoaderState& s) {
  Impl& m = *impl_;
  SPES_CHECK(s.epoch >= 0 && s.position >= 0 && s.position <= m.per_epoch,
             "loader state (epoch {}, position {}) does not fit this data: {} windows per epoch "
             "(did data.paths, seq_len or the node count change since the checkpoint?)",
             s.epoch, s.position, m.per_epoch);
  if (s.epoch != m.st.epoch || m.order.empty()) m.build_order(s.epoch);
  m.st = s;
}

void BatchLoader::reset() { restore(LoaderState{}); }

int64_t BatchLoader::num_windows() const { return impl_->per_epoch; }
int64_t BatchLoader::total_tokens() const { return impl_->corpus->total_tokens(); }
int64_t BatchLoader::vocab_size_hint() const { return impl_->vocab_hint; }

}  // namespace spes
