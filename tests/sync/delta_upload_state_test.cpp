// A node's compressed-sync state as its checkpoint keeps it (DeltaUpload::saved_state /
// restore_state; docs/PROTOCOL.md "What resets"): the base and the error feedback (int8's
// residual, top-k's accumulator) as of the last published model the node took, not what an
// upload since then changed; taken back into a fresh DeltaUpload on the checkpoint's weights,
// the next rounds give bit for bit what the node that was never stopped gives. A state that
// does not match the model (a wrong shape, NaN, an unknown or missing tensor, another dtype) is
// refused naming the tensor, and changes nothing. With topk_unsent_in_weights the node trains
// on the published model plus what it has not sent, and every change is still sent once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "spes/sync/round/delta_upload.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {

const std::string kEmbed = "model.embed_tokens.weight";

struct Node {
  FakeNode fake;
  DeltaUpload delta;
  Node(const Config& cfg, uint64_t seed)
      : fake(cfg, 0, seed),
        delta(cfg.spes_config.transfer.compression, topk_params(cfg.spes_config.transfer),
              cfg.spes_config.transfer.topk_decay,
              topk_published_params(cfg.spes_config.transfer),
              cfg.spes_config.transfer.topk_unsent_in_weights) {}
};

void train(FakeNode& n, uint64_t seed) {
  torch::NoGradGuard ng;
  torch::manual_seed(seed);
  for (const auto& e : n.reg->entries())
    if (e.trainable) e.tensor.add_(torch::randn(e.tensor.sizes()) * 0.01);
}

// A round whose upload the server used: encode, take the rebuilt tensors, new base.
void round(Node& n, int64_t r) {
  n.delta.encode(*n.fake.reg, UploadMeta{0, r, r * 10, 80, 1, ""});
  n.delta.apply_rebuilt(*n.fake.reg);
  n.delta.set_base(*n.fake.reg, false, r, "sha of round " + std::to_string(r));
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor x = a.contiguous(), y = b.contiguous();
  return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

::testing::AssertionResult same_state(const DeltaUpload::SavedState& a,
                                      const DeltaUpload::SavedState& b) {
  if (a.round != b.round || a.model_sha256 != b.model_sha256 ||
      a.tensors.size() != b.tensors.size())
    return ::testing::AssertionFailure() << "round, digest or tensor count differ";
  for (size_t i = 0; i < a.tensors.size(); ++i)
    if (a.tensors[i].first != b.tensors[i].first ||
        !same_bits(a.tensors[i].second, b.tensors[i].second))
      return ::testing::AssertionFailure() << "tensor " << a.tensors[i].first << " differs";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_weights(const FakeNode& a, const FakeNode& b) {
  for (size_t i = 0; i < a.reg->entries().size(); ++i)
    if (!same_bits(a.reg->entries()[i].tensor, b.reg->entries()[i].tensor))
      return ::testing::AssertionFailure() << a.reg->entries()[i].name << " differs";
  return ::testing::AssertionSuccess();
}

TEST(DeltaUploadState, ARestoredStateContinuesBitForBitAndIgnoresAnUnfinishedUpload) {
  for (const char* c : {"topk", "int8"}) {
    SCOPED_TRACE(c);
    const Config cfg = tiny_config({std::string("spes_config.compression=") + c,
                                    "spes_config.topk_density=0.05"});
    Node a(cfg, 5);
    a.delta.set_base(*a.fake.reg, true, 0, "sha of round 0");
    for (int64_t r = 1; r <= 3; ++r) {
      train(a.fake, 100 + r);
      round(a, r);
    }
    train(a.fake, 104);  // the checkpoint's weights, four steps after round 3
    const DeltaUpload::SavedState at_round_3 = a.delta.saved_state();
    EXPECT_EQ(at_round_3.round, 3);
    EXPECT_EQ(at_round_3.model_sha256, "sha of round 3");
    // The upload of round 4, whose round the node did not finish: the saved state is still
    // the one of round 3 (a stopped node does that round again from there).
    a.delta.encode(*a.fake.reg, UploadMeta{0, 4, 40, 80, 1, ""});
    ASSERT_TRUE(same_state(a.delta.saved_state(), at_round_3));

    // A restarted node: the checkpoint's weights and the saved state, in a fresh DeltaUpload.
    Node b(cfg, 5);
    {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < a.fake.reg->entries().size(); ++i)
        b.fake.reg->entries()[i].tensor.copy_(a.fake.reg->entries()[i].tensor);
    }
    b.delta.set_base(*b.fake.reg, true);  // what a node does first at its start
    b.delta.restore_state(*b.fake.reg, at_round_3);
    ASSERT_TRUE(same_state(b.delta.saved_state(), at_round_3));
    b.delta.encode(*b.fake.reg, UploadMeta{0, 4, 40, 80, 1, ""});
    EXPECT_EQ(b.delta.upload_data_bytes(*b.fake.reg), a.delta.upload_data_bytes(*a.fake.reg));
    EXPECT_DOUBLE_EQ(b.delta.residual_sq(), a.delta.residual_sq());
    for (Node* n : {&a, &b}) {
      n->delta.apply_rebuilt(*n->fake.reg);
      n->delta.set_base(*n->fake.reg, false, 4, "sha of round 4");
    }
    EXPECT_TRUE(same_weights(a.fake, b.fake));
    EXPECT_TRUE(same_state(a.delta.saved_state(), b.delta.saved_state()));
    for (Node* n : {&a, &b}) {  // and the round after
      train(n->fake, 105);
      round(*n, 5);
    }
    EXPECT_TRUE(same_weights(a.fake, b.fake));
    EXPECT_TRUE(same_state(a.delta.saved_state(), b.delta.saved_state()));
    // The feedback holds something (the test would pass trivially with none).
    EXPECT_GT(a.delta.residual_sq(), 0);
  }
}

// The trainable tensors of `n`, as fp32 CPU copies by name.
std::map<std::string, torch::Tensor> trainable(const FakeNode& n) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : n.reg->entries())
    if (e.trainable) out[e.name] = e.tensor.detach().to(torch::kFloat32).clone();
  return out;
}

// Tensor `key` ("base/<name>" or "residual/<name>") of a saved state (undefined: none).
torch::Tensor saved(const DeltaUpload::SavedState& s, const std::string& key) {
  for (const auto& [n, t] : s.tensors)
    if (n == key) return t;
  return {};
}

// One node whose uploads the server takes as they are (the published model is base +
// deq(sent)): with topk_unsent_in_weights the node trains, after each round, on the published
// model plus its accumulator a (W = base + a), and with topk_decay 1 what it published plus
// what it holds is still exactly what it trained (each change sent once, none twice); without
// it the node trains on the published model alone, with the same bookkeeping.
TEST(DeltaUploadState, UnsentInWeightsTrainsOnPublishedPlusHeldAndSendsEachChangeOnce) {
  for (const char* in_weights : {"true", "false"}) {
    SCOPED_TRACE(std::string("topk_unsent_in_weights=") + in_weights);
    const Config cfg =
        tiny_config({"spes_config.compression=topk", "spes_config.topk_density=0.05",
                     std::string("spes_config.topk_unsent_in_weights=") + in_weights});
    const bool on = cfg.spes_config.transfer.topk_unsent_in_weights;
    Node a(cfg, 5);
    EXPECT_EQ(a.delta.unsent_in_weights(), on);
    a.delta.set_base(*a.fake.reg, true, 0, "sha of round 0");
    const auto start = trainable(a.fake);
    std::map<std::string, torch::Tensor> trained;  // the sum of what training changed
    for (const auto& [name, t] : start) trained[name] = torch::zeros_like(t);
    for (int64_t r = 1; r <= 4; ++r) {
      const auto before = trainable(a.fake);
      train(a.fake, 200 + r);
      for (const auto& [name, t] : trainable(a.fake)) trained[name] += t - before.at(name);
      round(a, r);
      a.delta.add_unsent(*a.fake.reg);
      const DeltaUpload::SavedState st = a.delta.saved_state();
      const auto w = trainable(a.fake);
      double held_sq = 0;
      for (const auto& [name, t] : w) {
        const torch::Tensor base = saved(st, "base/" + name), held = saved(st, "residual/" + name);
        ASSERT_TRUE(base.defined() && held.defined()) << name;
        held_sq += held.pow(2).sum().item<double>();
        const torch::Tensor held_v = held.view(base.sizes());
        // What the node trains on next.
        EXPECT_TRUE(torch::allclose(t, on ? base + held_v : base, 0, 1e-6))
            << name << " round " << r;
        // Published (base - start) plus held = everything trained.
        EXPECT_TRUE(torch::allclose(base - start.at(name) + held_v, trained.at(name), 0, 1e-5))
            << name << " round " << r;
      }
      EXPECT_GT(held_sq, 0) << "round " << r;  // something is held (else the test is empty)
    }
  }
}

TEST(DeltaUploadState, AStateThatDoesNotMatchTheModelIsRefusedNamingTheTensor) {
  const Config cfg = tiny_config({"spes_config.compression=topk", "spes_config.topk_density=0.05"});
  Node a(cfg, 5);
  a.delta.set_base(*a.fake.reg, true, 0, "sha0");
  train(a.fake, 1);
  round(a, 1);
  const DeltaUpload::SavedState good = a.delta.saved_state();
  const auto with = [&](const std::string& name, const std::function<torch::Tensor(torch::Tensor)>& f) {
    DeltaUpload::SavedState s = good;
    for (auto& [n, t] : s.tensors)
      if (n == name) t = f(t.clone());
    return s;
  };
  struct Case {
    DeltaUpload::SavedState state;
    std::string error;
  };
  DeltaUpload::SavedState unknown = good, missing = good;
  unknown.tensors.emplace_back("residual/model.no_such.weight", torch::zeros({2}));
  missing.tensors.erase(missing.tensors.begin());  // the first base
  DeltaUpload::SavedState unprefixed = good;
  unprefixed.tensors.emplace_back(kEmbed, torch::zeros({2}));
  const std::vector<Case> cases = {
      {with("residual/" + kEmbed, [](torch::Tensor t) { return t.reshape({-1}); }),
       "tensor 'residual/" + kEmbed + "' has shape ["},
      {with("base/" + kEmbed, [](torch::Tensor t) { return t.narrow(0, 0, 1).clone(); }),
       "tensor 'base/" + kEmbed + "' has shape ["},
      {with("residual/" + kEmbed, [](torch::Tensor t) { t.view(-1)[3] = NAN; return t; }),
       "tensor 'residual/" + kEmbed + "' holds NaN or Inf values"},
      {with("base/" + kEmbed, [](torch::Tensor t) { t.view(-1)[0] = INFINITY; return t; }),
       "tensor 'base/" + kEmbed + "' holds NaN or Inf values"},
      {with("residual/" + kEmbed, [](torch::Tensor t) { return t.to(torch::kFloat64); }),
       "tensor 'residual/" + kEmbed + "' is Double, not F32"},
      {unknown, "tensor 'residual/model.no_such.weight' names no trainable tensor of this model"},
      {missing, "tensor '" + good.tensors.front().first + "' is missing"},
      {unprefixed, "tensor '" + kEmbed + "' is neither base/<name> nor residual/<name>"},
  };
  ASSERT_TRUE(std::any_of(good.tensors.begin(), good.tensors.end(),
                          [](const auto& p) { return p.first == "residual/" + kEmbed; }));
  for (const Case& c : cases) {
    Node b(cfg, 5);
    b.delta.set_base(*b.fake.reg, true, 7, "before");
    const DeltaUpload::SavedState before = b.delta.saved_state();
    EXPECT_THAT(error_of([&] { b.delta.restore_state(*b.fake.reg, c.state); }),
                HasSubstr(c.error));
    EXPECT_TRUE(same_state(b.delta.saved_state(), before)) << c.error;  // nothing changed
  }
  // int8 needs every residual; top-k's may be absent (a tensor not encoded yet).
  const Config int8 = tiny_config({"spes_config.compression=int8"});
  Node c(int8, 5);
  DeltaUpload::SavedState no_residual = good;
  auto& nt = no_residual.tensors;
  nt.erase(std::remove_if(nt.begin(), nt.end(),
                          [](const auto& p) { return p.first == "residual/" + kEmbed; }),
           nt.end());
  EXPECT_THAT(error_of([&] { c.delta.restore_state(*c.fake.reg, no_residual); }),
              HasSubstr("tensor 'residual/" + kEmbed + "' is missing"));
  Node d(cfg, 5);
  EXPECT_EQ(error_of([&] { d.delta.restore_state(*d.fake.reg, no_residual); }), "");
}

}  // namespace
