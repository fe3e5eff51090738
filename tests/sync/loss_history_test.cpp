// The server's per-node loss curve (LossHistory): bounded, evenly thinned over the whole run,
// always ending at the latest point; non-finite losses skipped; a node that goes back to an
// older step (restarted from its checkpoint) replaces the points from that step on.
#include <gtest/gtest.h>

#include <cmath>

#include "spes/common/error.h"
#include "spes/sync/server/loss_history.h"

using namespace spes;
using namespace spes::sync;

namespace {

std::vector<int64_t> steps_of(const LossHistory& h) {
  std::vector<int64_t> out;
  for (const LossPoint& p : h.points()) out.push_back(p.step);
  return out;
}

TEST(LossHistory, KeepsEveryPointUntilFull) {
  LossHistory h(8);
  for (int64_t s = 1; s <= 8; ++s) h.add(s, 10.0 - s);
  EXPECT_EQ(steps_of(h), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(h.points().back().loss, 2.0);
  EXPECT_EQ(h.stride(), 1);
}

TEST(LossHistory, ThinsEvenlyOverTheWholeRunAndEndsAtTheLatestPoint) {
  LossHistory h(8);
  for (int64_t s = 1; s <= 1000; ++s) h.add(s, 1.0 / s);
  const std::vector<LossPoint> pts = h.points();
  ASSERT_LE(pts.size(), 9u);  // capacity + the latest point
  ASSERT_GE(pts.size(), 5u);
  EXPECT_EQ(h.stride(), 128);
  // Evenly spaced multiples of the stride from the start of the run, then the latest step.
  for (size_t i = 0; i + 1 < pts.size(); ++i) EXPECT_EQ(pts[i].step, 128 * (int64_t(i) + 1));
  EXPECT_EQ(pts.back().step, 1000);
  EXPECT_DOUBLE_EQ(pts.back().loss, 1.0 / 1000);
}

TEST(LossHistory, SkipsNonFiniteLossesAndRestartsReplaceLaterPoints) {
  LossHistory h(100);
  for (int64_t s = 1; s <= 30; ++s) h.add(s, 5.0);
  h.add(31, NAN);
  h.add(32, INFINITY);
  EXPECT_EQ(h.points().back().step, 30);
  // The node restarted from its checkpoint at step 20: steps 21.. are trained again.
  h.add(21, 4.0);
  h.add(22, 3.5);
  const std::vector<LossPoint> pts = h.points();
  ASSERT_EQ(pts.size(), 22u);
  EXPECT_EQ(pts[19].step, 20);
  EXPECT_EQ(pts[20].step, 21);
  EXPECT_EQ(pts[20].loss, 4.0);
  EXPECT_EQ(pts[21].step, 22);
  EXPECT_THROW(LossHistory(1), Error);
}

}  // namespace
