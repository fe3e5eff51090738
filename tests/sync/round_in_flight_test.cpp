// RoundInFlight (spes_config.overlap): the round works on a copy taken at the upload while the
// live weights keep training; applying it gives every trainable tensor P + (live - S), checked
// against the same sum in float64, and every frozen tensor P; with no training since the upload
// the node holds P bit for bit. Also: ready() only once the exchange ended, its failure comes
// back from wait(), bytes() counts the copy and S, and the next round reuses a finished round's
// copy and S with the same result.
#include <gtest/gtest.h>

#include <future>
#include <stdexcept>

#include "spes/sync/node/round_in_flight.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;

namespace {

// Sets every tensor of `reg` to the same tensor of `from` (the published model P).
void assign(const ParamRegistry& reg, const ParamRegistry& from) {
  torch::NoGradGuard ng;
  for (const auto& e : reg.entries()) e.tensor.copy_(from.find(e.name)->tensor);
}

// One step of "training": every trainable live tensor moves by a seeded random amount.
void train(const ParamRegistry& live, uint64_t seed) {
  torch::NoGradGuard ng;
  torch::manual_seed(seed);
  for (const auto& e : live.entries())
    if (e.trainable) e.tensor.add_(torch::randn_like(e.tensor) * 0.01);
}

// Where the buffers' tensors live (to see that a round reused them).
std::vector<const void*> memory_of(const InFlightBuffers& b) {
  std::vector<const void*> m;
  for (const auto& e : b.copy->entries()) m.push_back(e.tensor.data_ptr());
  for (const auto& t : b.uploaded) m.push_back(t.data_ptr());
  return m;
}

}  // namespace

TEST(RoundInFlight, AppliesThePublishedModelPlusTheProgressSinceTheUpload) {
  const Config cfg = tiny_config();
  FakeNode node(cfg, 0, 1), published(cfg, 0, 2);
  const ParamRegistry& live = *node.reg;
  std::map<std::string, torch::Tensor> uploaded;
  for (const auto& e : live.entries()) uploaded[e.name] = e.tensor.detach().clone();

  std::promise<void> trained;
  std::shared_future<void> go = trained.get_future().share();
  RoundInFlight r(live, 1, 10, 19, [&](const ParamRegistry& copy) {
    // The copy holds the weights as uploaded, even while the live ones train.
    go.wait();
    for (const auto& e : copy.entries()) {
      EXPECT_TRUE(torch::equal(e.tensor, uploaded[e.name])) << e.name;
      EXPECT_FALSE(e.tensor.requires_grad()) << e.name;
      EXPECT_EQ(e.trainable, live.find(e.name)->trainable) << e.name;
    }
    assign(copy, *published.reg);
    RoundExchange x;
    x.record = {{"round", 1}};
    return x;
  });
  EXPECT_EQ(r.round(), 1);
  EXPECT_EQ(r.step(), 10);
  EXPECT_EQ(r.deadline(), 19);
  train(live, 7);
  train(live, 8);
  EXPECT_FALSE(r.ready());  // the exchange waits for `go`
  std::map<std::string, torch::Tensor> before_apply;
  for (const auto& e : live.entries()) before_apply[e.name] = e.tensor.detach().clone();
  trained.set_value();
  const RoundExchange x = r.wait();
  EXPECT_FALSE(x.needs_catch_up());
  EXPECT_EQ(x.record["round"], 1);
  r.apply(live);

  int64_t trainable = 0, frozen = 0;
  for (const auto& e : live.entries()) {
    const torch::Tensor p = published.reg->find(e.name)->tensor.detach();
    if (!e.trainable) {
      ++frozen;
      EXPECT_TRUE(torch::equal(e.tensor, p)) << e.name;
      continue;
    }
    ++trainable;
    const torch::Tensor want = p.to(torch::kFloat64) +
                               (before_apply[e.name].to(torch::kFloat64) -
                                uploaded[e.name].to(torch::kFloat64));
    EXPECT_TRUE(torch::allclose(e.tensor.detach().to(torch::kFloat64), want, 0, 1e-6)) << e.name;
    EXPECT_FALSE(torch::equal(e.tensor, p)) << e.name << ": the progress was dropped";
    EXPECT_TRUE(e.tensor.requires_grad()) << e.name;
  }
  EXPECT_GT(trainable, 0);
  EXPECT_GT(frozen, 0);  // node 0 of 2 owns 2 of the 4 experts
}

TEST(RoundInFlight, WithoutTrainingSinceTheUploadTheNodeHoldsThePublishedModelExactly) {
  const Config cfg = tiny_config();
  FakeNode node(cfg, 1, 3), published(cfg, 1, 4);
  const ParamRegistry& live = *node.reg;
  RoundInFlight r(live, 2, 20, 20, [&](const ParamRegistry& copy) {
    assign(copy, *published.reg);
    return RoundExchange{{{"round", 2}}, -1, ""};
  });
  uint64_t all = 0, trainable = 0;
  for (const auto& e : live.entries()) {
    all += e.tensor.numel() * 4;
    if (e.trainable) trainable += e.tensor.numel() * 4;
  }
  EXPECT_EQ(r.bytes(), all + trainable);
  r.wait();
  r.apply(live);
  EXPECT_EQ(live.weights_sha256(), published.reg->weights_sha256());
}

TEST(RoundInFlight, AFailedExchangeComesBackFromWaitAndCannotBeApplied) {
  const Config cfg = tiny_config();
  FakeNode node(cfg, 0, 5);
  const std::string sha = node.reg->weights_sha256();
  RoundInFlight r(*node.reg, 1, 10, 15, [](const ParamRegistry&) -> RoundExchange {
    throw std::runtime_error("server gone");
  });
  try {
    r.wait();
    FAIL() << "wait() did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "server gone");
  }
  EXPECT_THROW(r.apply(*node.reg), Error);
  EXPECT_EQ(node.reg->weights_sha256(), sha);  // the live weights were never touched
}

TEST(RoundInFlight, TheNextRoundReusesTheBuffersAndGivesTheSameBits) {
  // Two nodes with the same weights run the same two rounds; one hands round 1's buffers to
  // round 2, the other allocates afresh. Round 2 works in round 1's memory, its copy holds the
  // live weights as uploaded, and both nodes end with the same bits.
  const Config cfg = tiny_config();
  FakeNode a(cfg, 0, 5), b(cfg, 0, 5), p1(cfg, 0, 6), p2(cfg, 0, 7);
  const auto publish = [](const ParamRegistry& p) {
    return [&p](const ParamRegistry& copy) {
      assign(copy, p);
      return RoundExchange{{{"round", 1}}, -1, ""};
    };
  };
  // Both nodes train the same steps while their rounds are in flight, then apply them.
  const auto train_and_apply = [&](RoundInFlight& ra, RoundInFlight& rb, uint64_t seed) {
    train(*a.reg, seed);
    train(*b.reg, seed);
    ra.wait();
    rb.wait();
    ra.apply(*a.reg);
    rb.apply(*b.reg);
  };
  RoundInFlight ra(*a.reg, 1, 10, 19, publish(*p1.reg)), rb(*b.reg, 1, 10, 19, publish(*p1.reg));
  train_and_apply(ra, rb, 3);
  InFlightBuffers kept = ra.release();
  EXPECT_THROW(ra.apply(*a.reg), Error);  // released: no longer applicable
  const std::vector<const void*> memory = memory_of(kept);

  train(*a.reg, 4);
  train(*b.reg, 4);
  std::map<std::string, torch::Tensor> at_upload;
  for (const auto& e : a.reg->entries()) at_upload[e.name] = e.tensor.detach().clone();
  RoundInFlight ra2(*a.reg, 2, 20, 29, [&](const ParamRegistry& copy) {
    for (const auto& e : copy.entries())
      EXPECT_TRUE(torch::equal(e.tensor, at_upload[e.name])) << e.name;
    assign(copy, *p2.reg);
    return RoundExchange{{{"round", 2}}, -1, ""};
  }, std::move(kept));
  RoundInFlight rb2(*b.reg, 2, 20, 29, publish(*p2.reg));
  train_and_apply(ra2, rb2, 5);
  EXPECT_EQ(memory_of(ra2.release()), memory);
  EXPECT_EQ(a.reg->weights_sha256(), b.reg->weights_sha256());
  EXPECT_NE(a.reg->weights_sha256(), p2.reg->weights_sha256());  // the progress is kept
}
