// One worker thread that runs queued jobs in the order they were queued, off the caller's
// critical path: the sync server's cleanup after a publication (removing the replaced model
// file and the staged uploads, saving the drift window) while nodes already download the
// round. A job's exception is logged with the job's name, never thrown into the caller; wait()
// blocks until every job queued so far has run, and the destructor runs what is queued before
// the thread ends.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace spes {

class BackgroundQueue {
 public:
  explicit BackgroundQueue(std::string name);
  ~BackgroundQueue();
  BackgroundQueue(const BackgroundQueue&) = delete;
  BackgroundQueue& operator=(const BackgroundQueue&) = delete;
  // Queues `job` (`what` names it in the log when it fails).
  void post(std::string what, std::function<void()> job);
  // Blocks until every job posted before this call has run; returns how many of all jobs
  // run so far failed.
  uint64_t wait();

 private:
  void loop();
  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::string, std::function<void()>>> jobs_;
  uint64_t posted_ = 0, done_ = 0, failed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace spes
