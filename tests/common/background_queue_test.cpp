// BackgroundQueue (common/background_queue.h): jobs run on one thread in the order they were
// posted, wait() returns once every job posted before it has run, a failing job is counted and
// logged without stopping the ones after it, and destruction runs what is still queued.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "spes/common/background_queue.h"

using spes::BackgroundQueue;

TEST(BackgroundQueue, RunsJobsInOrderOffTheCallersThreadAndWaitsForThem) {
  BackgroundQueue q("test");
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  std::atomic<bool> release{false};
  // The first job holds the queue until released: the caller does not wait for it to post.
  q.post("gate", [&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  for (int i = 0; i < 20; ++i)
    q.post("job", [&, i] {
      std::lock_guard<std::mutex> lk(mu);
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    });
  {
    std::lock_guard<std::mutex> lk(mu);
    EXPECT_TRUE(order.empty());
  }
  release = true;
  EXPECT_EQ(q.wait(), 0u);
  std::vector<int> want(20);
  for (int i = 0; i < 20; ++i) want[i] = i;
  EXPECT_EQ(order, want);
  for (const auto& t : threads) {
    EXPECT_NE(t, std::this_thread::get_id());
    EXPECT_EQ(t, threads.front());
  }
}

TEST(BackgroundQueue, AFailingJobIsCountedAndTheNextOnesStillRun) {
  BackgroundQueue q("test");
  int ran = 0;
  q.post("first", [&] { ++ran; });
  q.post("broken", [] { throw std::runtime_error("disk on fire"); });
  q.post("third", [&] { ++ran; });
  EXPECT_EQ(q.wait(), 1u);
  EXPECT_EQ(ran, 2);
  EXPECT_EQ(q.wait(), 1u);  // nothing new posted: returns at once, same count
}

TEST(BackgroundQueue, DestructionRunsWhatIsStillQueued) {
  std::atomic<int> ran{0};
  {
    BackgroundQueue q("test");
    for (int i = 0; i < 5; ++i)
      q.post("slow", [&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        ++ran;
      });
  }
  EXPECT_EQ(ran.load(), 5);
}
