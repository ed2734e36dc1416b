// File: agents/core/buffer_pool.h
//
// BufferPool: receive buffers for large tensors, reused instead of freshly allocated.
// Memory fresh from the kernel is page-faulted in on first touch, which halves (or
// worse) the bandwidth of a large receive (PEERS.md: 1.7 GB/s into fresh memory, 7.4
// GB/s into reused memory). A buffer goes back to the pool when the last Tensor using
// it is destroyed, wherever that happens.
//
//   auto pool = BufferPool::create(256 << 20);
//   absl::StatusOr<std::shared_ptr<void>> buffer = pool->get(64 << 20);
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tensor/cuda.h"
#include "tensor/tensor.h"

namespace ferry::internal {

// Thread-safe. Buffers hold a weak reference to the pool: one that outlives it is
// simply freed.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Keeps at most `max_cached_bytes` of idle buffers.
  static std::shared_ptr<BufferPool> create(size_t max_cached_bytes);
  ~BufferPool();

  // A 64-byte-aligned CPU buffer of at least `bytes` bytes.
  absl::StatusOr<std::shared_ptr<void>> get(size_t bytes);

  size_t cached_bytes() const;
  uint64_t hits() const;
  uint64_t misses() const;

 private:
  explicit BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  // An idle buffer, and the runtime whose page-locked memory it is (null: the C heap).
  struct Idle {
    void* ptr;
    std::shared_ptr<CudaRuntime> pinned_by;
  };
  void put(void* ptr, size_t size, std::shared_ptr<CudaRuntime> pinned_by) ABSL_LOCKS_EXCLUDED(mu_);

  const size_t max_cached_bytes_;
  mutable absl::Mutex mu_;
  std::multimap<size_t, Idle> idle_ ABSL_GUARDED_BY(mu_);  // size class -> buffer
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
};

// Receive buffers at least this large come from a BufferPool; smaller ones are cheap
// to allocate and rarely page-fault.
inline constexpr size_t kPooledBufferBytes = 64 * 1024;

// FERRY_RECEIVE_CACHE_MB caps the idle receive buffers a transport keeps for reuse (0:
// none).
size_t max_cached_receive_bytes();

// A uint8 CPU tensor of `length` bytes for a transport to land received bytes in: from
// `pool` when large or page-locked, else freshly allocated.
absl::StatusOr<Tensor> receive_buffer(const std::shared_ptr<BufferPool>& pool, size_t length);

// From now on, every receive buffer of this process is page-locked memory of `runtime`
// (null: the C heap again), whatever its size. The agent core sets it when its worker
// handles CUDA devices: a host-to-device copy out of page-locked memory is queued
// without the host waiting, so the staging channel may land received bytes on the
// transport thread that read them. A buffer is freed by the allocator it came from.
void pin_receive_buffers(std::shared_ptr<CudaRuntime> runtime);

}  // namespace ferry::internal
