#include "agents/ring/read_pool.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "agents/ring/split_read.h"
#include "base/thread_name.h"

namespace ferry::internal::ring {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

bool ReadJob::stalled(std::chrono::nanoseconds timeout) const {
  return now_ns() - progress_ns.load(std::memory_order_relaxed) > timeout.count();
}

struct ReadPool::State {
  explicit State(uint64_t split) : split_bytes(split) {}
  const uint64_t split_bytes;
  std::mutex mu;
  std::condition_variable wake;
  std::deque<std::shared_ptr<ReadJob>> queue;  // guarded by mu
  size_t idle = 0;                             // threads waiting for a job, guarded by mu
  size_t threads = 0;                          // alive, guarded by mu
  bool stopping = false;                       // guarded by mu
  std::atomic<uint64_t> split_reads{0};
};

ReadPool::ReadPool(uint64_t split_bytes) : state_(std::make_shared<State>(split_bytes)) {}

ReadPool::~ReadPool() { stop(); }

void ReadPool::submit(std::shared_ptr<ReadJob> job) {
  job->progress_ns.store(now_ns(), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->stopping) {
      state_->queue.push_back(job);
      // A thread stuck in a read is never idle: a new job gets a thread of its own.
      if (state_->queue.size() > state_->idle && state_->threads < kMaxThreads) {
        ++state_->threads;
        std::thread([state = state_] { serve(state); }).detach();
      }
      state_->wake.notify_one();
      return;
    }
  }
  job->result = absl::CancelledError("the transport is closing");
  job->finished.store(true, std::memory_order_release);
  if (job->done) job->done();
}

void ReadPool::stop() {
  std::deque<std::shared_ptr<ReadJob>> dropped;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
    dropped.swap(state_->queue);
  }
  state_->wake.notify_all();
}

uint64_t ReadPool::split_reads() const { return state_->split_reads.load(std::memory_order_relaxed); }

size_t ReadPool::threads() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->threads;
}

void ReadPool::run(State& state, SplitReader& reader, ReadJob& job) {
  absl::Status result;
  for (ReadJob::Piece& piece : job.pieces) {
    auto* into = static_cast<uint8_t*>(piece.into.data());
    const uint64_t bytes = piece.into.nbytes();
    for (uint64_t at = 0; at < bytes && result.ok(); at += kChunkBytes) {
      const uint64_t n = std::min(kChunkBytes, bytes - at);
      const uint64_t splits = reader.split_reads();
      result = reader.read(job.pid, into + at, piece.address + at, n);
      state.split_reads.fetch_add(reader.split_reads() - splits, std::memory_order_relaxed);
      job.progress_ns.store(now_ns(), std::memory_order_relaxed);
    }
    if (!result.ok()) break;
  }
  job.result = std::move(result);
  job.finished.store(true, std::memory_order_release);
  if (job.done) job.done();
}

void ReadPool::serve(std::shared_ptr<State> state) {
  name_this_thread("ferry-ring-read");
  SplitReader reader(state->split_bytes);
  std::unique_lock<std::mutex> lock(state->mu);
  for (;;) {
    ++state->idle;
    state->wake.wait(lock, [&] { return state->stopping || !state->queue.empty(); });
    --state->idle;
    if (state->queue.empty()) break;  // stopping
    std::shared_ptr<ReadJob> job = std::move(state->queue.front());
    state->queue.pop_front();
    lock.unlock();
    run(*state, reader, *job);
    job.reset();  // the buffers go now, not at the next job
    lock.lock();
  }
  --state->threads;
}

}  // namespace ferry::internal::ring
