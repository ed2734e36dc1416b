#include "tensor/emulated_cuda.h"

#include <fcntl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "base/status.h"
#include "tensor/emulated_ipc.h"
#include "tensor/emulated_stream.h"

namespace ferry {
namespace {

constexpr size_t kAlignment = 256;  // what cudaMalloc guarantees
constexpr unsigned char kPoison = 0xA5;
// Copies up to this size queued on an idle stream run on the calling thread. Larger ones
// always run on the stream's thread, as a GPU's copy engine runs them beside the host:
// what a caller overlaps with a large copy must not find it already done.
constexpr size_t kInlineCopyBytes = size_t{64} << 10;

size_t round_up(size_t bytes) { return (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment; }

std::string where(int device) { return device < 0 ? std::string("pinned host") : absl::StrCat("cuda:", device); }

}  // namespace

class EmulatedCudaRuntime::Impl {
 public:
  enum class State { kLive, kFreeQueued, kPooled, kQuarantined };
  // One allocation: device memory (from the pool or the "driver") or pinned memory.
  struct Block {
    size_t size = 0;
    int device = -1;  // -1: pinned host memory
    bool pooled = false;  // came from a device pool (allocate_async)
    State state = State::kLive;
    int pending = 0;  // queued copies that use it
    std::string last_user;  // the stream of the last copy queued on it
    // While kFreeQueued: the stream the free is queued on, and the free's ticket there.
    std::shared_ptr<EmulatedStream> freed_on;
    uint64_t free_ticket = 0;
  };
  struct Event {
    int device = 0;
    std::shared_ptr<EmulatedStream> stream;  // null: never recorded
    uint64_t ticket = 0;
    // An inter-process event: its counters in shared memory, and whether it was
    // destroyed here (a wait on it then gives up; its recorder may be gone).
    std::shared_ptr<internal::IpcEventSegment> ipc;
    int slot = -1;
    std::shared_ptr<std::atomic<bool>> abandoned;
  };

  Impl(int device_count, const EmulatedCudaOptions& options) : device_count_(device_count), options_(options) {
    absl::MutexLock lock(&mu_);
    pools_.resize(static_cast<size_t>(std::max(device_count, 0)));
    arenas_.resize(static_cast<size_t>(std::max(device_count, 0)));
    stats_.resize(static_cast<size_t>(std::max(device_count, 0)));
  }

  ~Impl() {
    // Drain every stream first: their operations touch the tables below.
    std::vector<std::shared_ptr<EmulatedStream>> streams;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [id, s] : streams_) streams.push_back(s);
      for (auto& [id, e] : events_) {
        if (e.abandoned) e.abandoned->store(true);
      }
      for (auto& s : default_streams_) {
        if (s) streams.push_back(s);
      }
    }
    for (auto& s : streams) s->stop();
    absl::MutexLock lock(&mu_);
    streams_.clear();
    default_streams_.clear();
    events_.clear();
    for (auto& [addr, block] : blocks_) {
      if (!block.pooled) std::free(reinterpret_cast<void*>(addr));
    }
    blocks_.clear();
    arenas_.clear();  // pool memory: gone with its memfd (and any importer's mapping stays valid)
  }

  const int device_count_;
  const EmulatedCudaOptions options_;

  void misuse(std::string what) ABSL_LOCKS_EXCLUDED(misuse_mu_) {
    std::string line = absl::StrCat("emulated CUDA misuse: ", what);
    if (options_.abort_on_misuse) {
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
      std::abort();
    }
    absl::MutexLock lock(&misuse_mu_);
    misuses_.push_back(std::move(line));
  }
  std::vector<std::string> misuses() const ABSL_LOCKS_EXCLUDED(misuse_mu_) {
    absl::MutexLock lock(&misuse_mu_);
    return misuses_;
  }

  absl::Status check_device(int device) const {
    if (device < 0 || device >= device_count_) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda:", device, " out of range (the emulated runtime has ", device_count_, " devices)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<EmulatedStream>> stream(CudaStream s, const char* use) ABSL_LOCKS_EXCLUDED(mu_) {
    if (absl::Status st = check_device(s.device); !st.ok()) return st;
    std::shared_ptr<EmulatedStream> found;
    {
      absl::MutexLock lock(&mu_);
      if (s.handle == nullptr) {
        std::shared_ptr<EmulatedStream>& d = default_streams_[static_cast<size_t>(s.device)];
        if (!d) d = std::make_shared<EmulatedStream>(s.device, absl::StrCat("the default stream of cuda:", s.device));
        return d;
      }
      auto it = streams_.find(reinterpret_cast<uintptr_t>(s.handle));
      if (it != streams_.end()) found = it->second;
    }
    if (!found) {
      std::string what = absl::StrCat(use, " on stream ", reinterpret_cast<uintptr_t>(s.handle), " of cuda:",
                                      s.device, ", which was destroyed or never created");
      misuse(what);
      return absl::FailedPreconditionError(what);
    }
    if (found->device() != s.device) {
      return absl::InvalidArgumentError(
          absl::StrCat(use, ": ", found->name(), " is not on cuda:", s.device));
    }
    return found;
  }

  absl::StatusOr<CudaStream> create_stream(int device) ABSL_LOCKS_EXCLUDED(mu_) {
    if (absl::Status st = check_device(device); !st.ok()) return st;
    absl::MutexLock lock(&mu_);
    uintptr_t id = ++next_id_;
    streams_.emplace(id, std::make_shared<EmulatedStream>(device, absl::StrCat("stream ", id, " of cuda:", device)));
    return CudaStream{device, reinterpret_cast<void*>(id)};
  }

  void destroy_stream(CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    if (s.handle == nullptr) return;  // the default stream lives as long as the runtime
    std::shared_ptr<EmulatedStream> gone;
    {
      absl::MutexLock lock(&mu_);
      auto it = streams_.find(reinterpret_cast<uintptr_t>(s.handle));
      if (it != streams_.end()) {
        gone = std::move(it->second);
        streams_.erase(it);
      }
    }
    if (!gone) {
      misuse(absl::StrCat("destroy_stream of stream ", reinterpret_cast<uintptr_t>(s.handle),
                          ", which was destroyed or never created"));
      return;
    }
    // As in CUDA, work already queued still runs; events recorded on it keep it alive.
    gone->stop();
  }

  // ---- Memory ----

  // The block holding [p, p + bytes), or null when p is not memory of this runtime.
  Block* find(const void* p, uintptr_t* base) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = blocks_.upper_bound(a);
    if (it == blocks_.begin()) return nullptr;
    --it;
    if (a >= it->first + it->second.size) return nullptr;
    *base = it->first;
    return &it->second;
  }

  // Device `device`'s pool memory, a memfd (so the pool can be exported), made on first use.
  absl::StatusOr<internal::MemfdArena*> arena(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::unique_ptr<internal::MemfdArena>& a = arenas_[static_cast<size_t>(device)];
    if (!a) {
      absl::StatusOr<std::unique_ptr<internal::MemfdArena>> made =
          internal::MemfdArena::create(device, options_.pool_capacity);
      if (!made.ok()) return made.status();
      a = *std::move(made);
    }
    return a.get();
  }

  absl::StatusOr<void*> new_block(int device, size_t size, bool pooled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    void* p = nullptr;
    if (pooled) {
      absl::StatusOr<internal::MemfdArena*> a = arena(device);
      if (!a.ok()) return a.status();
      p = (*a)->allocate(size);
    } else {
      p = std::aligned_alloc(kAlignment, size);
    }
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("out of memory allocating ", size, " bytes on ", where(device)));
    }
    Block b;
    b.size = size;
    b.device = device;
    b.pooled = pooled;
    blocks_.emplace(reinterpret_cast<uintptr_t>(p), b);
    return p;
  }

  absl::StatusOr<void*> allocate(int device, size_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    if (device >= 0) {
      if (absl::Status st = check_device(device); !st.ok()) return st;
    }
    absl::MutexLock lock(&mu_);
    return new_block(device, round_up(bytes), /*pooled=*/false);
  }

  // Frees a block at once (deallocate, deallocate_pinned).
  void free_now(int device, void* ptr, const char* call) ABSL_LOCKS_EXCLUDED(mu_) {
    std::string problem;
    {
      absl::MutexLock lock(&mu_);
      auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == blocks_.end() || it->second.pooled || it->second.device != device) {
        problem = absl::StrCat(call, " of ", reinterpret_cast<uintptr_t>(ptr), " on ", where(device),
                               ", which is not a live allocation of that kind");
      } else if (it->second.state != State::kLive) {
        problem = absl::StrCat(call, ": ", where(device), " memory at ", it->first, " freed twice");
      } else if (it->second.pending > 0) {
        problem = absl::StrCat(call, ": ", where(device), " memory at ", it->first, " (", it->second.size,
                               " bytes) freed while ", it->second.pending,
                               it->second.pending == 1 ? " queued copy still uses" : " queued copies still use",
                               " it (last queued on ",
                               it->second.last_user, ")");
        it->second.state = State::kQuarantined;  // kept, so the queued copy does not touch freed memory
      } else {
        std::free(ptr);
        blocks_.erase(it);
      }
    }
    if (!problem.empty()) misuse(problem);
  }

  absl::StatusOr<void*> allocate_async(int device, size_t bytes, CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    if (absl::Status st = check_device(device); !st.ok()) return st;
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "allocate_async");
    if (!st.ok()) return st.status();
    size_t need = round_up(bytes);
    void* p = nullptr;
    for (;;) {
      // As CUDA's pool does, memory freed on this same stream may serve this stream: it
      // is used after the free in the stream's order. The emulator returns it to the
      // pool when the stream passes the free (where misuse is checked), so it waits for
      // that here rather than asking the "driver" for more.
      std::shared_ptr<EmulatedStream> freeing;
      uint64_t ticket = 0;
      {
        absl::MutexLock lock(&mu_);
        Pool& pool = pools_[static_cast<size_t>(device)];
        auto it = pool.idle.lower_bound(need);
        if (it != pool.idle.end() && it->first <= 2 * need) break;
        for (auto& [addr, b] : blocks_) {
          if (b.state == State::kFreeQueued && b.freed_on == *st && b.size >= need && b.size <= 2 * need) {
            freeing = b.freed_on;
            // 0: the free is being queued right now; what the stream has so far covers it.
            ticket = b.free_ticket;
            break;
          }
        }
      }
      if (!freeing) break;
      freeing->wait_passed(ticket != 0 ? ticket : freeing->last_ticket());
    }
    {
      absl::MutexLock lock(&mu_);
      Pool& pool = pools_[static_cast<size_t>(device)];
      CudaPoolStats& stats = stats_[static_cast<size_t>(device)];
      // A block at most twice the size asked for, so small tensors do not hold big blocks.
      auto it = pool.idle.lower_bound(need);
      if (it != pool.idle.end() && it->first <= 2 * need) {
        p = reinterpret_cast<void*>(it->second);
        pool.idle_bytes -= it->first;
        pool.idle.erase(it);
        blocks_[reinterpret_cast<uintptr_t>(p)].state = State::kLive;
      } else {
        absl::StatusOr<void*> fresh = new_block(device, need, /*pooled=*/true);
        if (!fresh.ok()) return fresh.status();
        p = *fresh;
        ++stats.driver_allocations;
        stats.driver_bytes += need;
      }
      stats.used_bytes += blocks_[reinterpret_cast<uintptr_t>(p)].size;
      ++stats.allocations;
      stats.bytes += bytes;
    }
    if (options_.poison) std::memset(p, kPoison, need);
    return p;
  }

  void deallocate_async(int device, void* ptr, CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "deallocate_async");
    if (!st.ok()) return;
    std::string problem;
    {
      absl::MutexLock lock(&mu_);
      auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == blocks_.end() || !it->second.pooled || it->second.device != device) {
        problem = absl::StrCat("deallocate_async of ", reinterpret_cast<uintptr_t>(ptr), " on cuda:", device,
                               ", which is not a live pool allocation of that device");
      } else if (it->second.state != State::kLive) {
        problem = absl::StrCat("deallocate_async: cuda:", device, " memory at ", it->first, " freed twice");
      } else {
        it->second.state = State::kFreeQueued;
        it->second.freed_on = *st;
        it->second.free_ticket = 0;
      }
    }
    if (!problem.empty()) {
      misuse(problem);
      return;
    }
    std::string stream_name = (*st)->name();
    uint64_t ticket = (*st)->enqueue([this, device, ptr, stream_name] { free_reached(device, ptr, stream_name); },
                                     /*run_if_idle=*/options_.copy_delay.count() == 0);
    absl::MutexLock lock(&mu_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != blocks_.end() && it->second.state == State::kFreeQueued) it->second.free_ticket = ticket;
  }

  // A stream reached a deallocate_async: the block returns to its pool.
  void free_reached(int device, void* ptr, const std::string& stream_name) ABSL_LOCKS_EXCLUDED(mu_) {
    std::string problem;
    {
      absl::MutexLock lock(&mu_);
      auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
      FERRY_CHECK(it != blocks_.end()) << "a queued free lost its block";
      Block& b = it->second;
      b.freed_on.reset();
      if (b.pending > 0) {
        problem = absl::StrCat("cuda:", device, " memory at ", it->first, " (", b.size, " bytes) returned to the pool by ",
                               stream_name, " while ", b.pending, b.pending == 1 ? " queued copy" : " queued copies",
                               " on another stream still use", b.pending == 1 ? "s" : "", " it (last queued on ", b.last_user,
                               "): order that stream before the free with an event");
        b.state = State::kQuarantined;
      } else {
        if (options_.poison) std::memset(ptr, kPoison, b.size);
        stats_[static_cast<size_t>(device)].used_bytes -= b.size;
        Pool& pool = pools_[static_cast<size_t>(device)];
        if (pool.idle_bytes + b.size <= options_.release_threshold) {
          b.state = State::kPooled;
          pool.idle.emplace(b.size, it->first);
          pool.idle_bytes += b.size;
        } else {
          arenas_[static_cast<size_t>(device)]->release(ptr, b.size);
          blocks_.erase(it);
        }
      }
    }
    if (!problem.empty()) misuse(problem);
  }

  CudaPoolStats pool_stats(int device) ABSL_LOCKS_EXCLUDED(mu_) {
    if (device < 0 || device >= device_count_) return {};
    absl::MutexLock lock(&mu_);
    return stats_[static_cast<size_t>(device)];
  }

  // ---- Copies ----

  absl::Status copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                          CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    for (Device d : {dst_device, src_device}) {
      if (!d.is_cuda()) continue;
      if (absl::Status st = check_device(d.index()); !st.ok()) return st;
    }
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "copy_async");
    if (!st.ok()) return st.status();
    if (bytes == 0) return absl::OkStatus();
    std::shared_ptr<EmulatedStream> on = *st;
    uintptr_t bases[2] = {0, 0};
    std::string problem;
    {
      absl::MutexLock lock(&mu_);
      const void* ends[2] = {dst, src};
      const char* dir[2] = {"into", "out of"};
      for (int k = 0; k < 2 && problem.empty(); ++k) {
        uintptr_t base = 0;
        Block* b = find(ends[k], &base);
        if (b == nullptr) continue;  // memory this runtime did not allocate (host pageable, from_blob)
        uintptr_t a = reinterpret_cast<uintptr_t>(ends[k]);
        if (b->state != State::kLive) {
          problem = absl::StrCat("a copy of ", bytes, " bytes on ", on->name(), " ", dir[k], " freed ",
                                 where(b->device), " memory at ", base);
        } else if (a + bytes > base + b->size) {
          problem = absl::StrCat("a copy of ", bytes, " bytes on ", on->name(), " ", dir[k], " ", where(b->device),
                                 " memory at ", a, " runs past the end of its ", b->size, "-byte block");
        } else {
          bases[k] = base;
        }
      }
      if (problem.empty()) {
        for (uintptr_t base : bases) {
          if (base == 0) continue;
          ++blocks_[base].pending;
          blocks_[base].last_user = on->name();
        }
      }
    }
    if (!problem.empty()) {
      misuse(problem);
      return absl::FailedPreconditionError(problem);
    }
    const std::chrono::microseconds delay = options_.copy_delay;
    // The time a copy engine of copy_gbps takes for these bytes (0: as fast as memmove).
    const auto engine = std::chrono::nanoseconds(
        options_.copy_gbps > 0 ? static_cast<int64_t>(static_cast<double>(bytes) / options_.copy_gbps) : 0);
    on->enqueue(
        [this, dst, src, bytes, delay, engine, d = bases[0], s2 = bases[1]] {
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      const auto started = std::chrono::steady_clock::now();
      std::memmove(dst, src, bytes);
      if (engine.count() > 0) std::this_thread::sleep_until(started + engine);
      absl::MutexLock lock(&mu_);
      for (uintptr_t base : {d, s2}) {
        auto it = blocks_.find(base);
        if (base != 0 && it != blocks_.end()) --it->second.pending;
      }
        },
        /*run_if_idle=*/delay.count() == 0 && engine.count() == 0 && bytes <= kInlineCopyBytes);
    return absl::OkStatus();
  }

  // ---- Events ----

  absl::StatusOr<CudaEvent> create_event(int device) ABSL_LOCKS_EXCLUDED(mu_) {
    if (absl::Status st = check_device(device); !st.ok()) return st;
    absl::MutexLock lock(&mu_);
    uintptr_t id = ++next_id_;
    Event e;
    e.device = device;
    events_.emplace(id, std::move(e));
    return CudaEvent{device, reinterpret_cast<void*>(id)};
  }

  void destroy_event(CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    bool known = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = events_.find(reinterpret_cast<uintptr_t>(e.handle));
      if (it != events_.end()) {
        known = true;
        if (it->second.abandoned) it->second.abandoned->store(true);
        events_.erase(it);
      }
    }
    if (!known) misuse(absl::StrCat("destroy_event of event ", reinterpret_cast<uintptr_t>(e.handle),
                                    ", which was destroyed or never created"));
  }

  // A copy of event `e`'s state, or an error (a misuse) when it was destroyed.
  absl::StatusOr<Event> event(CudaEvent e, const char* use) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      auto it = events_.find(reinterpret_cast<uintptr_t>(e.handle));
      if (it != events_.end()) return it->second;
    }
    std::string what = absl::StrCat(use, " on event ", reinterpret_cast<uintptr_t>(e.handle), " of cuda:", e.device,
                                    ", which was destroyed or never created");
    misuse(what);
    return absl::FailedPreconditionError(what);
  }

  absl::Status record(CudaEvent e, CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "record");
    if (!st.ok()) return st.status();
    absl::StatusOr<Event> ev = event(e, "record");
    if (!ev.ok()) return ev.status();
    if (ev->ipc) {
      // Record k of an inter-process event passes when this stream reaches it.
      const uint32_t generation = ev->ipc->slot(ev->slot).recorded.fetch_add(1, std::memory_order_acq_rel) + 1;
      (*st)->enqueue([seg = ev->ipc, slot = ev->slot, generation] { internal::ipc_complete(seg->slot(slot), generation); },
                     /*run_if_idle=*/options_.copy_delay.count() == 0);
      return absl::OkStatus();
    }
    uint64_t ticket = (*st)->last_ticket();
    absl::MutexLock lock(&mu_);
    auto it = events_.find(reinterpret_cast<uintptr_t>(e.handle));
    if (it == events_.end()) return absl::FailedPreconditionError("record: the event was destroyed meanwhile");
    it->second.stream = *st;
    it->second.ticket = ticket;
    return absl::OkStatus();
  }

  absl::Status wait(CudaStream s, CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "wait");
    if (!st.ok()) return st.status();
    absl::StatusOr<Event> ev = event(e, "wait");
    if (!ev.ok()) return ev.status();
    if (ev->ipc) {
      // The record made last so far, by this process or the event's other one.
      internal::IpcSlot& slot = ev->ipc->slot(ev->slot);
      const uint32_t generation = slot.recorded.load(std::memory_order_acquire);
      if (internal::ipc_passed(slot, generation)) return absl::OkStatus();
      (*st)->enqueue([seg = ev->ipc, i = ev->slot, generation, gone = ev->abandoned] {
        internal::ipc_wait(seg->slot(i), generation, *gone);
      });
      return absl::OkStatus();
    }
    // Never recorded, already passed, or the same stream (FIFO): nothing to hold back.
    if (!ev->stream || ev->stream == *st || ev->stream->passed(ev->ticket)) return absl::OkStatus();
    (*st)->enqueue([on = ev->stream, ticket = ev->ticket] { on->wait_passed(ticket); });
    return absl::OkStatus();
  }

  absl::Status synchronize(CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<Event> ev = event(e, "synchronize");
    if (!ev.ok()) return ev.status();
    if (ev->ipc) {
      internal::IpcSlot& slot = ev->ipc->slot(ev->slot);
      internal::ipc_wait(slot, slot.recorded.load(std::memory_order_acquire), *ev->abandoned);
      return absl::OkStatus();
    }
    if (ev->stream) ev->stream->wait_passed(ev->ticket);
    return absl::OkStatus();
  }

  absl::StatusOr<bool> query(CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<Event> ev = event(e, "query");
    if (!ev.ok()) return ev.status();
    if (ev->ipc) {
      internal::IpcSlot& slot = ev->ipc->slot(ev->slot);
      return internal::ipc_passed(slot, slot.recorded.load(std::memory_order_acquire));
    }
    return !ev->stream || ev->stream->passed(ev->ticket);
  }

  absl::Status synchronize(CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "synchronize");
    if (!st.ok()) return st.status();
    (*st)->wait_passed((*st)->last_ticket());
    return absl::OkStatus();
  }

  // ---- Inter-process memory and events ----

  absl::Status check_ipc(const char* call) const {
    if (options_.ipc) return absl::OkStatus();
    return absl::UnimplementedError(absl::StrCat(
        call, ": the emulated CUDA runtime was configured without IPC (EmulatedCudaOptions::ipc, FERRY_EMULATE_CUDA_IPC=0)"));
  }

  absl::StatusOr<int> export_pool(int device) ABSL_LOCKS_EXCLUDED(mu_) {
    FERRY_RETURN_IF_ERROR(check_ipc("export_pool"));
    FERRY_RETURN_IF_ERROR(check_device(device));
    absl::MutexLock lock(&mu_);
    absl::StatusOr<internal::MemfdArena*> a = arena(device);
    if (!a.ok()) return a.status();
    int fd = fcntl((*a)->fd(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return absl::ResourceExhaustedError(absl::StrCat("export_pool(cuda:", device, "): dup failed"));
    ++stats_[static_cast<size_t>(device)].exports;
    return fd;
  }

  absl::StatusOr<CudaImportedPool> import_pool(int fd) {
    FERRY_RETURN_IF_ERROR(check_ipc("import_pool"));
    absl::StatusOr<uintptr_t> handle = imports_.import_pool(fd);
    if (!handle.ok()) return handle.status();
    return CudaImportedPool{reinterpret_cast<void*>(*handle)};
  }

  void release_imported_pool(CudaImportedPool pool) {
    if (!imports_.release_pool(reinterpret_cast<uintptr_t>(pool.handle))) {
      misuse(absl::StrCat("release_imported_pool of ", reinterpret_cast<uintptr_t>(pool.handle),
                          ", which is not an imported pool"));
    }
  }

  absl::StatusOr<CudaPointerExport> export_pointer(void* ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    FERRY_RETURN_IF_ERROR(check_ipc("export_pointer"));
    absl::MutexLock lock(&mu_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == blocks_.end() || !it->second.pooled || it->second.state != State::kLive) {
      return absl::InvalidArgumentError(absl::StrCat("export_pointer of ", reinterpret_cast<uintptr_t>(ptr),
                                                     ", which is not the start of a live pool allocation"));
    }
    internal::MemfdArena* a = arenas_[static_cast<size_t>(it->second.device)].get();
    internal::ArenaPointer x{internal::kArenaPointerMagic, a->id(), a->offset_of(ptr), it->second.size};
    CudaPointerExport out;
    std::memcpy(out.data, &x, sizeof(x));
    return out;
  }

  absl::StatusOr<void*> import_pointer(CudaImportedPool pool, const CudaPointerExport& data) {
    return imports_.import_pointer(reinterpret_cast<uintptr_t>(pool.handle), data.data);
  }

  absl::Status release_imported_pointer(void* ptr, CudaStream s) {
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "release_imported_pointer");
    if (!st.ok()) return st.status();
    if (!imports_.has_pointer(ptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("release_imported_pointer of ", reinterpret_cast<uintptr_t>(ptr), ", which is not imported"));
    }
    // As a free: on an idle stream it runs here, so what the channel queues after it
    // (its event's record) does not wait for the stream's thread.
    (*st)->enqueue([this, ptr] { imports_.release_pointer(ptr); }, /*run_if_idle=*/options_.copy_delay.count() == 0);
    return absl::OkStatus();
  }

  // Events of one segment, as entries of the event table.
  std::vector<CudaEvent> add_ipc_events(int device, const std::shared_ptr<internal::IpcEventSegment>& seg,
                                        const std::vector<int>& slots) ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<CudaEvent> out;
    absl::MutexLock lock(&mu_);
    for (int slot : slots) {
      uintptr_t id = ++next_id_;
      events_.emplace(id, Event{device, nullptr, 0, seg, slot, std::make_shared<std::atomic<bool>>(false)});
      out.push_back(CudaEvent{device, reinterpret_cast<void*>(id)});
    }
    return out;
  }

  absl::StatusOr<std::vector<CudaEvent>> create_ipc_events(int device, int count) ABSL_LOCKS_EXCLUDED(mu_) {
    FERRY_RETURN_IF_ERROR(check_ipc("create_ipc_events"));
    FERRY_RETURN_IF_ERROR(check_device(device));
    absl::StatusOr<std::shared_ptr<internal::IpcEventSegment>> seg = internal::IpcEventSegment::create(count);
    if (!seg.ok()) return seg.status();
    std::vector<int> slots(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) slots[static_cast<size_t>(i)] = i;
    return add_ipc_events(device, *seg, slots);
  }

  absl::StatusOr<CudaIpcEvents> export_ipc_events(std::span<const CudaEvent> events) ABSL_LOCKS_EXCLUDED(mu_) {
    FERRY_RETURN_IF_ERROR(check_ipc("export_ipc_events"));
    std::shared_ptr<internal::IpcEventSegment> seg;
    internal::IpcEventHandles handles;
    {
      absl::MutexLock lock(&mu_);
      for (const CudaEvent& e : events) {
        auto it = events_.find(reinterpret_cast<uintptr_t>(e.handle));
        if (it == events_.end() || !it->second.ipc || it->second.ipc->fd() < 0 || (seg && seg != it->second.ipc)) {
          return absl::InvalidArgumentError(
              "export_ipc_events: every event must be a live one of a single create_ipc_events call here");
        }
        seg = it->second.ipc;
        handles.slots.push_back(it->second.slot);
      }
    }
    if (!seg) return absl::InvalidArgumentError("export_ipc_events: no events");
    handles.segment = seg->id();
    handles.count = seg->count();
    CudaIpcEvents out;
    out.fd = fcntl(seg->fd(), F_DUPFD_CLOEXEC, 0);
    if (out.fd < 0) return absl::ResourceExhaustedError("export_ipc_events: dup failed");
    out.handles = internal::encode_event_handles(handles);
    return out;
  }

  absl::StatusOr<std::vector<CudaEvent>> import_ipc_events(int device, int fd, std::string_view handles)
      ABSL_LOCKS_EXCLUDED(mu_) {
    FERRY_RETURN_IF_ERROR(check_ipc("import_ipc_events"));
    FERRY_RETURN_IF_ERROR(check_device(device));
    absl::StatusOr<internal::IpcEventHandles> h = internal::decode_event_handles(handles);
    if (!h.ok()) return h.status();
    absl::StatusOr<std::shared_ptr<internal::IpcEventSegment>> seg = internal::IpcEventSegment::open(fd, h->segment, h->count);
    if (!seg.ok()) return seg.status();
    std::vector<int> slots = h->slots;
    return add_ipc_events(device, *seg, slots);
  }

 private:
  struct Pool {
    std::multimap<size_t, uintptr_t> idle;  // blocks whose free their stream passed, by size
    uint64_t idle_bytes = 0;
  };

  mutable absl::Mutex misuse_mu_;
  std::vector<std::string> misuses_ ABSL_GUARDED_BY(misuse_mu_);

  absl::Mutex mu_;
  uintptr_t next_id_ ABSL_GUARDED_BY(mu_) = 0;  // stream and event handles; never reused
  std::map<uintptr_t, std::shared_ptr<EmulatedStream>> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<EmulatedStream>> default_streams_ ABSL_GUARDED_BY(mu_) =
      std::vector<std::shared_ptr<EmulatedStream>>(static_cast<size_t>(std::max(device_count_, 0)));
  std::map<uintptr_t, Event> events_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, Block> blocks_ ABSL_GUARDED_BY(mu_);  // by address
  std::vector<Pool> pools_ ABSL_GUARDED_BY(mu_);            // by device
  std::vector<std::unique_ptr<internal::MemfdArena>> arenas_ ABSL_GUARDED_BY(mu_);  // by device: pool memory
  internal::ImportTable imports_;
  std::vector<CudaPoolStats> stats_ ABSL_GUARDED_BY(mu_);   // by device
};

absl::StatusOr<EmulatedCudaOptions> EmulatedCudaOptions::from_environment() {
  EmulatedCudaOptions options;
  if (const char* v = std::getenv("FERRY_EMULATE_CUDA_DELAY_US"); v != nullptr && *v != '\0') {
    int64_t us = 0;
    if (!absl::SimpleAtoi(v, &us) || us < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("FERRY_EMULATE_CUDA_DELAY_US=\"", v, "\": expected a whole number of microseconds, 0 or more"));
    }
    options.copy_delay = std::chrono::microseconds(us);
  }
  if (const char* v = std::getenv("FERRY_EMULATE_CUDA_GBPS"); v != nullptr && *v != '\0') {
    double gbps = 0;
    if (!absl::SimpleAtod(v, &gbps) || !(gbps >= 0) || gbps > 1e6) {
      return absl::InvalidArgumentError(
          absl::StrCat("FERRY_EMULATE_CUDA_GBPS=\"", v, "\": expected a copy speed in GB/s, 0 (none) or more"));
    }
    options.copy_gbps = gbps;
  }
  if (const char* v = std::getenv("FERRY_EMULATE_CUDA_IPC"); v != nullptr && *v != '\0') {
    const std::string s(v);
    if (s != "0" && s != "1") {
      return absl::InvalidArgumentError(absl::StrCat("FERRY_EMULATE_CUDA_IPC=\"", s, "\": expected 0 or 1"));
    }
    options.ipc = s == "1";
  }
  if (const char* v = std::getenv("FERRY_EMULATE_CUDA_POISON"); v != nullptr && *v != '\0') {
    const std::string s(v);
    if (s != "0" && s != "1") {
      return absl::InvalidArgumentError(absl::StrCat("FERRY_EMULATE_CUDA_POISON=\"", s, "\": expected 0 or 1"));
    }
    options.poison = s == "1";
  }
  return options;
}

EmulatedCudaRuntime::EmulatedCudaRuntime(int device_count, EmulatedCudaOptions options)
    : options_(options), impl_(std::make_unique<Impl>(device_count, options)) {}

EmulatedCudaRuntime::~EmulatedCudaRuntime() = default;

int EmulatedCudaRuntime::device_count() { return std::max(impl_->device_count_, 0); }
std::string EmulatedCudaRuntime::unavailable_reason() {
  return impl_->device_count_ <= 0 ? "the emulated CUDA runtime was configured with 0 devices" : "";
}
absl::StatusOr<void*> EmulatedCudaRuntime::allocate(int device, size_t bytes) {
  if (device < 0) return impl_->check_device(device);
  return impl_->allocate(device, bytes);
}
void EmulatedCudaRuntime::deallocate(int device, void* ptr) { impl_->free_now(device, ptr, "deallocate"); }
absl::StatusOr<void*> EmulatedCudaRuntime::allocate_async(int device, size_t bytes, CudaStream stream) {
  return impl_->allocate_async(device, bytes, stream);
}
void EmulatedCudaRuntime::deallocate_async(int device, void* ptr, CudaStream stream) {
  impl_->deallocate_async(device, ptr, stream);
}
CudaPoolStats EmulatedCudaRuntime::pool_stats(int device) { return impl_->pool_stats(device); }
absl::StatusOr<void*> EmulatedCudaRuntime::allocate_pinned(size_t bytes) { return impl_->allocate(-1, bytes); }
void EmulatedCudaRuntime::deallocate_pinned(void* ptr) { impl_->free_now(-1, ptr, "deallocate_pinned"); }
absl::Status EmulatedCudaRuntime::copy_async(void* dst, Device dst_device, const void* src, Device src_device,
                                             size_t bytes, CudaStream stream) {
  return impl_->copy_async(dst, dst_device, src, src_device, bytes, stream);
}
absl::StatusOr<CudaStream> EmulatedCudaRuntime::create_stream(int device) { return impl_->create_stream(device); }
void EmulatedCudaRuntime::destroy_stream(CudaStream stream) { impl_->destroy_stream(stream); }
absl::Status EmulatedCudaRuntime::synchronize(CudaStream stream) { return impl_->synchronize(stream); }
absl::StatusOr<CudaEvent> EmulatedCudaRuntime::create_event(int device) { return impl_->create_event(device); }
void EmulatedCudaRuntime::destroy_event(CudaEvent event) { impl_->destroy_event(event); }
absl::Status EmulatedCudaRuntime::record(CudaEvent event, CudaStream stream) { return impl_->record(event, stream); }
absl::Status EmulatedCudaRuntime::wait(CudaStream stream, CudaEvent event) { return impl_->wait(stream, event); }
absl::Status EmulatedCudaRuntime::synchronize(CudaEvent event) { return impl_->synchronize(event); }
absl::StatusOr<bool> EmulatedCudaRuntime::query(CudaEvent event) { return impl_->query(event); }
std::vector<std::string> EmulatedCudaRuntime::misuses() const { return impl_->misuses(); }
absl::StatusOr<int> EmulatedCudaRuntime::export_pool(int device) { return impl_->export_pool(device); }
absl::StatusOr<CudaImportedPool> EmulatedCudaRuntime::import_pool(int fd) { return impl_->import_pool(fd); }
void EmulatedCudaRuntime::release_imported_pool(CudaImportedPool pool) { impl_->release_imported_pool(pool); }
absl::StatusOr<CudaPointerExport> EmulatedCudaRuntime::export_pointer(void* ptr) { return impl_->export_pointer(ptr); }
absl::StatusOr<void*> EmulatedCudaRuntime::import_pointer(CudaImportedPool pool, const CudaPointerExport& data) {
  return impl_->import_pointer(pool, data);
}
absl::Status EmulatedCudaRuntime::release_imported_pointer(void* ptr, CudaStream stream) {
  return impl_->release_imported_pointer(ptr, stream);
}
absl::StatusOr<std::vector<CudaEvent>> EmulatedCudaRuntime::create_ipc_events(int device, int count) {
  return impl_->create_ipc_events(device, count);
}
absl::StatusOr<CudaIpcEvents> EmulatedCudaRuntime::export_ipc_events(std::span<const CudaEvent> events) {
  return impl_->export_ipc_events(events);
}
absl::StatusOr<std::vector<CudaEvent>> EmulatedCudaRuntime::import_ipc_events(int device, int fd,
                                                                              std::string_view handles) {
  return impl_->import_ipc_events(device, fd, handles);
}

}  // namespace ferry
