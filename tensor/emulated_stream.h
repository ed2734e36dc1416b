// File: tensor/emulated_stream.h (not installed)
//
// EmulatedStream: one stream of the emulated CUDA runtime (tensor/emulated_cuda.h), a
// FIFO of operations run in order by its own thread. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ferry {

// One stream: a FIFO of operations run in order by its own thread. Ticket k is the k-th
// operation enqueued (from 1); the stream has passed ticket k once k operations ran.
class EmulatedStream {
 public:
  EmulatedStream(int device, std::string name) : device_(device), name_(std::move(name)) {
    thread_ = std::thread([this] { run(); });
  }
  ~EmulatedStream() { stop(); }

  int device() const { return device_; }
  const std::string& name() const { return name_; }

  // `run_if_idle`: when the stream has nothing queued or running, it has reached the
  // operation already, and the calling thread runs it (only non-blocking operations of
  // a runtime without copy delay, which then saves two thread hand-offs per copy).
  uint64_t enqueue(std::function<void()> op, bool run_if_idle = false) ABSL_LOCKS_EXCLUDED(mu_) {
    uint64_t ticket = 0;
    {
      absl::MutexLock lock(&mu_);
      ticket = ++enqueued_;
      if (!run_if_idle || running_ || !queue_.empty()) {
        queue_.push_back(std::move(op));
        cv_.Signal();
        return ticket;
      }
      running_ = true;
    }
    op();
    absl::MutexLock lock(&mu_);
    running_ = false;
    ++completed_;
    done_cv_.SignalAll();
    // Only what was queued meanwhile needs the stream's thread: waking it for nothing
    // costs two context switches per operation on a small host.
    if (!queue_.empty()) cv_.Signal();
    return ticket;
  }
  // The ticket of the last operation enqueued so far (0: none).
  uint64_t last_ticket() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return enqueued_;
  }
  bool passed(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return completed_ >= ticket;
  }
  void wait_passed(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    while (completed_ < ticket) done_cv_.Wait(&mu_);
  }
  // Runs what is queued, then ends the thread.
  void stop() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      cv_.Signal();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() ABSL_LOCKS_EXCLUDED(mu_) {
    for (;;) {
      std::function<void()> op;
      {
        absl::MutexLock lock(&mu_);
        while ((queue_.empty() || running_) && !stopping_) cv_.Wait(&mu_);
        while (running_) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      op();
      absl::MutexLock lock(&mu_);
      running_ = false;
      ++completed_;
      done_cv_.SignalAll();
    }
  }

  const int device_;
  const std::string name_;
  absl::Mutex mu_;
  absl::CondVar cv_;       // work queued, or stopping
  absl::CondVar done_cv_;  // completed_ went up
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // an operation runs, on the thread or inline
  std::thread thread_;
};

}  // namespace ferry
