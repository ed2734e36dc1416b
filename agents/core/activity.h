// File: agents/core/activity.h
//
// Activity: a count of an agent's unfinished work (calls awaiting replies, pool tasks
// queued or running) that a thread can wait on to reach zero. One counter for both,
// so work handed from one to the other (a reply whose continuation is posted to the
// pool) never lets it touch zero in between: the task is counted in before the call
// is counted out.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace ferry::internal {

// Thread-safe.
class Activity {
 public:
  void enter() { count_.fetch_add(1, std::memory_order_relaxed); }
  void exit() {
    if (count_.fetch_sub(1, std::memory_order_acq_rel) == 1 && waiters_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
  }
  int64_t count() const { return count_.load(std::memory_order_acquire); }

  // True once the count is zero, false when `timeout` passed first.
  bool wait_idle(std::chrono::milliseconds timeout) {
    if (count() == 0) return true;
    std::unique_lock<std::mutex> lock(mu_);
    waiters_.fetch_add(1, std::memory_order_acq_rel);
    bool idle = cv_.wait_for(lock, timeout, [this] { return count() == 0; });
    waiters_.fetch_sub(1, std::memory_order_acq_rel);
    return idle;
  }

 private:
  std::atomic<int64_t> count_{0};
  std::atomic<int> waiters_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace ferry::internal
