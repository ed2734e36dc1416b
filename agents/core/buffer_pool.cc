#include "agents/core/buffer_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/env.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kPage = 4096;

// Sizes are rounded up to a page, and to 1/8 of their power of two above 1 MiB, so
// that similar sizes share buffers without wasting more than 12.5%.
size_t size_class(size_t bytes) {
  size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  if (rounded <= (size_t{1} << 20)) return rounded == 0 ? kPage : rounded;
  size_t top = size_t{1} << (63 - __builtin_clzll(rounded));
  size_t step = top / 8;
  return (rounded + step - 1) / step * step;
}

// pin_receive_buffers()'s runtime.
struct Pinning {
  absl::Mutex mu;
  std::shared_ptr<CudaRuntime> runtime ABSL_GUARDED_BY(mu);
  std::atomic<bool> on{false};  // read without the lock on every receive
};

Pinning& pinning() {
  static Pinning* p = new Pinning;
  return *p;
}

std::shared_ptr<CudaRuntime> pinning_runtime() {
  Pinning& p = pinning();
  if (!p.on.load(std::memory_order_acquire)) return nullptr;
  absl::MutexLock lock(&p.mu);
  return p.runtime;
}

void release(void* ptr, const std::shared_ptr<CudaRuntime>& pinned_by) {
  if (pinned_by) {
    pinned_by->deallocate_pinned(ptr);
  } else {
    std::free(ptr);
  }
}

}  // namespace

void pin_receive_buffers(std::shared_ptr<CudaRuntime> runtime) {
  Pinning& p = pinning();
  absl::MutexLock lock(&p.mu);
  p.on.store(runtime != nullptr, std::memory_order_release);
  p.runtime = std::move(runtime);
}

std::shared_ptr<BufferPool> BufferPool::create(size_t max_cached_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
}

BufferPool::~BufferPool() {
  for (auto& [size, idle] : idle_) release(idle.ptr, idle.pinned_by);
}

absl::StatusOr<std::shared_ptr<void>> BufferPool::get(size_t bytes) {
  size_t size = size_class(bytes);
  std::shared_ptr<CudaRuntime> pinned_by = pinning_runtime();
  void* ptr = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto [from, to] = idle_.equal_range(size);
    auto it = std::find_if(from, to, [&](const auto& entry) { return entry.second.pinned_by == pinned_by; });
    if (it != to) {
      ptr = it->second.ptr;
      idle_.erase(it);
      cached_bytes_ -= size;
      ++hits_;
    } else {
      ++misses_;
    }
  }
  if (ptr == nullptr) {
    if (pinned_by) {
      absl::StatusOr<void*> pinned = pinned_by->allocate_pinned(size);
      if (!pinned.ok()) {
        return absl::Status(pinned.status().code(), absl::StrCat("cannot allocate a ", bytes,
                                                                 "-byte page-locked receive buffer: ",
                                                                 pinned.status().message()));
      }
      ptr = *pinned;
    } else {
      ptr = std::aligned_alloc(kAlignment, size);
    }
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("out of memory allocating a ", bytes, "-byte receive buffer"));
    }
  }
  std::weak_ptr<BufferPool> weak = weak_from_this();
  return std::shared_ptr<void>(ptr, [weak, size, pinned_by = std::move(pinned_by)](void* p) mutable {
    if (std::shared_ptr<BufferPool> pool = weak.lock()) {
      pool->put(p, size, std::move(pinned_by));
    } else {
      release(p, pinned_by);
    }
  });
}

void BufferPool::put(void* ptr, size_t size, std::shared_ptr<CudaRuntime> pinned_by) {
  {
    absl::MutexLock lock(&mu_);
    if (cached_bytes_ + size <= max_cached_bytes_) {
      idle_.emplace(size, Idle{ptr, std::move(pinned_by)});
      cached_bytes_ += size;
      return;
    }
  }
  release(ptr, pinned_by);
}

size_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}
uint64_t BufferPool::hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}
uint64_t BufferPool::misses() const {
  absl::MutexLock lock(&mu_);
  return misses_;
}

size_t max_cached_receive_bytes() {
  static const size_t mb = static_cast<size_t>(env_int("FERRY_RECEIVE_CACHE_MB", 512, 0, 1 << 20));
  return mb << 20;
}

absl::StatusOr<Tensor> receive_buffer(const std::shared_ptr<BufferPool>& pool, size_t length) {
  if (length < kPooledBufferBytes && !pinning().on.load(std::memory_order_relaxed)) {
    return Tensor::empty({static_cast<int64_t>(length)}, DType::kUInt8);
  }
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<void> storage, pool->get(length));
  return Tensor::from_blob(std::move(storage), {static_cast<int64_t>(length)}, DType::kUInt8);
}

}  // namespace ferry::internal
