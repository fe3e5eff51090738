// Limits on the sync server's streams, without gRPC (server.cpp hands each stream a function
// that cancels it): one stream per node and kind at a time (a new Upload or Download of a node
// supersedes and cancels the one still open), and a watchdog that cancels a stream whose
// handler has waited too long for the client's next message (the first message within
// first_message_s, later ones within idle_s). Leaves out: credentials (call_auth.h) and the
// thread and stream caps of the transport (server.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

namespace spes::sync {

enum class StreamKind { Upload, Download };

class StreamLimits {
 public:
  StreamLimits(double first_message_s, double idle_s);
  ~StreamLimits();  // stops the watchdog
  StreamLimits(const StreamLimits&) = delete;
  StreamLimits& operator=(const StreamLimits&) = delete;

  // One open stream; ends (releases its slot and its watch) when destroyed. Must not outlive
  // the StreamLimits nor the stream `cancel` cancels.
  class Lease {
   public:
    ~Lease();
    // Brackets a wait for the client's next message: the watchdog cancels the stream when it
    // lasts longer than the limit (first_message_s before the first message, idle_s after).
    void waiting();
    void received();
    bool superseded() const { return superseded_; }  // a newer stream of the node took over
    bool timed_out() const { return timed_out_; }    // the watchdog cancelled it

   private:
    friend class StreamLimits;
    Lease(StreamLimits& owner, int64_t node, StreamKind kind, std::function<void()> cancel);
    StreamLimits& owner_;
    int64_t node_;
    StreamKind kind_;
    std::function<void()> cancel_;
    bool got_first_ = false;
    bool waiting_ = false;
    std::chrono::steady_clock::time_point since_;
    std::atomic<bool> superseded_{false}, timed_out_{false};
  };

  // Registers a stream of `node` (already authenticated) of `kind`; cancels and marks
  // superseded the node's stream of that kind still open.
  std::unique_ptr<Lease> open(int64_t node, StreamKind kind, std::function<void()> cancel);
  size_t open_streams() const;

 private:
  void watch();
  const std::chrono::duration<double> first_message_, idle_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::pair<int64_t, int>, Lease*> slots_;  // (node, kind) -> newest stream
  std::set<Lease*> leases_;                          // every open stream
  std::thread watchdog_;
};

}  // namespace spes::sync
