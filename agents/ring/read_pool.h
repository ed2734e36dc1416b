// File: agents/ring/read_pool.h (not installed)
//
// ReadPool: reads the tensors a peer sends by address (process_vm_readv) on threads of
// its own, off the thread that steps every ring of the worker (agents/ring/endpoint.h).
// A source page can take any time to arrive: a region registered with userfaultfd that
// nobody serves, a file mapped from storage that stalls. A stepping thread stuck in one
// read would stall every ring of the worker, and its shutdown with it.
//
// A job is one message's reads. It goes to an idle reader thread, or to a new one (up
// to kMaxThreads; past that it waits for one), so that a read stuck on one connection
// delays no other connection's. It reads in chunks of at most kChunkBytes and stamps
// its progress after each: the stepping thread gives up on a job whose stamp is older
// than RingOptions::in_place_read_timeout and closes that one connection.
//
// A read stuck in the kernel cannot be interrupted (the fault waits killably, for a
// fatal signal only) nor cancelled. So reader threads are detached and own what they
// touch: the pool's state and the job (its destination buffers among them) are shared,
// and a thread stuck past the end of the transport finishes when the page comes or the
// peer exits (its userfaultfd then goes, which fails the fault), and then leaves.
// stop() never waits for a reader.
//
//   ReadPool pool(8 << 20);
//   auto job = std::make_shared<ReadJob>();
//   job->pid = pid;
//   job->pieces.push_back({tensor, address});
//   job->done = [] { /* wake whoever waits */ };
//   pool.submit(job);
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "tensor/tensor.h"

namespace ferry::internal::ring {

class SplitReader;

// One message's in-place reads. The submitter fills in the first part before submit();
// the reader sets `result`, then `finished` (release), then calls `done`.
struct ReadJob {
  struct Piece {
    Tensor into;  // the buffer the bytes land in (held: the job may outlive its message)
    uint64_t address = 0;  // in the peer's process
  };
  pid_t pid = 0;
  std::vector<Piece> pieces;
  // Runs on the reader thread once the job finished; must not block.
  std::function<void()> done;

  absl::Status result;              // read once `finished` is true
  std::atomic<bool> finished{false};
  // steady_clock nanoseconds of the submission, then of each chunk read.
  std::atomic<int64_t> progress_ns{0};

  // Whether no chunk came for longer than `timeout` (any thread).
  bool stalled(std::chrono::nanoseconds timeout) const;
};

// Thread-safe. Owned by the endpoint; its threads share its state and outlive it
// when stuck (see the banner).
class ReadPool {
 public:
  // Reader threads at most: past them, a job waits for one to be free.
  static constexpr size_t kMaxThreads = 32;
  // The most one process_vm_readv call (or two, when split) reads between progress stamps.
  static constexpr uint64_t kChunkBytes = uint64_t{16} << 20;

  // Chunks of at least `split_bytes` are read by two threads at once (SplitReader).
  explicit ReadPool(uint64_t split_bytes);
  ReadPool(const ReadPool&) = delete;
  ReadPool& operator=(const ReadPool&) = delete;
  ~ReadPool();  // stop()

  // Starts `job` (stamping its progress now). After stop(), the job finishes at once,
  // kCancelled, on the calling thread.
  void submit(std::shared_ptr<ReadJob> job);
  // Idle readers leave, busy ones once their job is done; none is waited for.
  void stop();

  // Chunks read in two halves so far, and the reader threads alive (any thread).
  uint64_t split_reads() const;
  size_t threads() const;

 private:
  struct State;
  static void serve(std::shared_ptr<State> state);
  // One job, on the calling reader thread; then `finished` and `done`.
  static void run(State& state, SplitReader& reader, ReadJob& job);
  const std::shared_ptr<State> state_;
};

}  // namespace ferry::internal::ring
