// The throttle of the sync server's refusal logs (src/spes/sync/server/log_throttle.h), on an
// injected clock: one line per key and window, then one summary with the count of the rest;
// keys are independent; a flood of distinct keys stays bounded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spes/sync/server/log_throttle.h"

using spes::sync::LogThrottle;
using ::testing::ElementsAre;

TEST(LogThrottle, OneLinePerKeyAndWindowThenACountOfTheRest) {
  LogThrottle::Clock::time_point now{};
  LogThrottle t(10, [&] { return now; });
  EXPECT_EQ(t.admit("node 0|Upload|3", "Upload refused: a"), "Upload refused: a");
  for (int i = 0; i < 37; ++i) {
    now += std::chrono::milliseconds(100);
    EXPECT_EQ(t.admit("node 0|Upload|3", "Upload refused: b" + std::to_string(i)), std::nullopt);
  }
  // Another key (another node, or another kind of refusal) has its own window.
  EXPECT_EQ(t.admit("node 1|Upload|3", "Upload refused: c"), "Upload refused: c");
  EXPECT_EQ(t.admit("node 0|Join|3", "Join refused: d"), "Join refused: d");
  EXPECT_TRUE(t.flush().empty());  // no window has passed yet
  now += std::chrono::seconds(7);  // node 0's first window (started at 0) has passed
  EXPECT_THAT(t.flush(), ElementsAre("Upload refused: b36 (37 more like this in the last 10 s)"));
  EXPECT_TRUE(t.flush().empty());  // reported once
  // After its window the key starts over: the next line is logged at once.
  EXPECT_EQ(t.admit("node 0|Upload|3", "Upload refused: e"), "Upload refused: e");
  EXPECT_EQ(t.admit("node 0|Upload|3", "Upload refused: f"), std::nullopt);
  // A window that passed without a flush: its count goes with the next line.
  now += std::chrono::seconds(11);
  EXPECT_EQ(t.admit("node 0|Upload|3", "Upload refused: g"),
            "Upload refused: g (1 more like this before it)");
  // Keys whose window passed with nothing held back are forgotten silently.
  now += std::chrono::seconds(11);
  EXPECT_TRUE(t.flush().empty());
  EXPECT_EQ(t.keys(), 0u);
}

TEST(LogThrottle, AFloodOfDistinctKeysSharesOneOverflowKey) {
  LogThrottle::Clock::time_point now{};
  LogThrottle t(10, [&] { return now; }, /*max_keys=*/4);
  int logged = 0;
  for (int i = 0; i < 1000; ++i)
    logged += t.admit("peer " + std::to_string(i), "refused " + std::to_string(i)).has_value();
  EXPECT_EQ(logged, 5);  // four keys, then one line for all the others
  EXPECT_LE(t.keys(), 5u);
  now += std::chrono::seconds(10);
  EXPECT_THAT(t.flush(), ElementsAre("refused 999 (995 more like this in the last 10 s)"));
}

// Issue 35, finding 6: each of many sources (a stranger rotating addresses) gets its first line
// logged, so the log grew without bound. A total cap: at most max_lines lines a window in all;
// the rest counted and summed up in one line once the window has passed.
TEST(LogThrottle, ATotalCapHoldsBackLinesFromManySourcesAndSaysHowMany) {
  LogThrottle::Clock::time_point now{};
  LogThrottle t(10, [&] { return now; }, /*max_keys=*/4096, /*max_lines=*/50);
  int logged = 0;
  for (int i = 0; i < 1000; ++i)
    logged += t.admit("peer " + std::to_string(i), "refused " + std::to_string(i)).has_value();
  EXPECT_EQ(logged, 50);
  EXPECT_TRUE(t.flush().empty());  // within the window: nothing yet
  now += std::chrono::seconds(10);
  EXPECT_THAT(t.flush(), ElementsAre("log cap: 950 more lines of refused calls were not logged "
                                     "over the last 10 s (at most 50 such lines every 10 s); "
                                     "the last: refused 999"));
  EXPECT_TRUE(t.flush().empty());  // reported once
  // The next window logs again, up to the cap.
  logged = 0;
  for (int i = 0; i < 80; ++i)
    logged += t.admit("other " + std::to_string(i), "refused again").has_value();
  EXPECT_EQ(logged, 50);
}
