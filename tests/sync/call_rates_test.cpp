// CallRates (src/spes/sync/server/call_rates.h) with an injected clock: the burst, the refill,
// callers and RPCs kept apart, unlimited RPCs, and the bound on the callers it remembers.
#include <gtest/gtest.h>

#include <string>

#include "spes/sync/server/call_rates.h"

using spes::sync::CallRate;
using spes::sync::CallRates;

namespace {

struct FakeClock {
  CallRates::Clock::time_point t{};
  void advance(double s) {
    t += std::chrono::duration_cast<CallRates::Clock::duration>(std::chrono::duration<double>(s));
  }
};

int admitted(CallRates& r, const std::string& caller, const std::string& rpc, int calls) {
  int n = 0;
  for (int i = 0; i < calls; ++i) n += r.admit(caller, rpc) ? 1 : 0;
  return n;
}

}  // namespace

TEST(CallRates, BurstThenRefillAtTheRate) {
  FakeClock c;
  CallRates r({{"Heartbeat", {2, 5}}}, [&] { return c.t; });
  EXPECT_EQ(admitted(r, "node 1", "Heartbeat", 10), 5);  // the burst, then nothing
  c.advance(1.0);
  EXPECT_EQ(admitted(r, "node 1", "Heartbeat", 10), 2);  // 2 a second
  c.advance(0.25);
  EXPECT_EQ(admitted(r, "node 1", "Heartbeat", 10), 0);  // half a call is not a call
  c.advance(0.25);
  EXPECT_EQ(admitted(r, "node 1", "Heartbeat", 10), 1);
  c.advance(100);
  EXPECT_EQ(admitted(r, "node 1", "Heartbeat", 10), 5);  // refills up to the burst only
}

TEST(CallRates, CallersAndRpcsHaveTheirOwnBucketsAndUnlistedRpcsAreFree) {
  FakeClock c;
  CallRates r({{"Heartbeat", {1, 3}}, {"Join", {1, 1}}}, [&] { return c.t; });
  EXPECT_EQ(admitted(r, "node 1", "Heartbeat", 10), 3);
  EXPECT_EQ(admitted(r, "node 0", "Heartbeat", 10), 3);  // node 1's flood costs node 0 nothing
  EXPECT_EQ(admitted(r, "node 1", "Join", 10), 1);
  EXPECT_EQ(admitted(r, "node 1", "Leave", 10), 10);     // not limited
  EXPECT_EQ(r.rate("Heartbeat").burst, 3);
  EXPECT_EQ(r.rate("Leave").per_s, 0);
}

TEST(CallRates, RemembersBoundedCallersAndAFloodOfNewOnesSharesOneBucket) {
  FakeClock c;
  CallRates r({{"Status", {1, 2}}}, [&] { return c.t; }, /*max_keys=*/4);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(r.admit("host " + std::to_string(i), "Status"));
  // Every bucket is in use (none has refilled): new callers share the overflow bucket.
  EXPECT_EQ(admitted(r, "host 100", "Status", 1) + admitted(r, "host 101", "Status", 1) +
                admitted(r, "host 102", "Status", 5),
            2);
  EXPECT_LE(r.keys(), 5u);
  // Once the old buckets have refilled they are forgotten, and a new caller has its own.
  c.advance(10);
  EXPECT_EQ(admitted(r, "host 200", "Status", 5), 2);
  EXPECT_LE(r.keys(), 5u);
}
