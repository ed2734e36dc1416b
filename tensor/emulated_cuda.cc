#include "tensor/emulated_cuda.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
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
  };

  Impl(int device_count, const EmulatedCudaOptions& options) : device_count_(device_count), options_(options) {
    absl::MutexLock lock(&mu_);
    pools_.resize(static_cast<size_t>(std::max(device_count, 0)));
    stats_.resize(static_cast<size_t>(std::max(device_count, 0)));
  }

  ~Impl() {
    // Drain every stream first: their operations touch the tables below.
    std::vector<std::shared_ptr<EmulatedStream>> streams;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [id, s] : streams_) streams.push_back(s);
      for (auto& s : default_streams_) {
        if (s) streams.push_back(s);
      }
    }
    for (auto& s : streams) s->stop();
    absl::MutexLock lock(&mu_);
    streams_.clear();
    default_streams_.clear();
    events_.clear();
    for (auto& [addr, block] : blocks_) std::free(reinterpret_cast<void*>(addr));
    blocks_.clear();
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

  absl::StatusOr<void*> new_block(int device, size_t size, bool pooled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    void* p = std::aligned_alloc(kAlignment, size);
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
        Pool& pool = pools_[static_cast<size_t>(device)];
        if (pool.idle_bytes + b.size <= options_.release_threshold) {
          b.state = State::kPooled;
          pool.idle.emplace(b.size, it->first);
          pool.idle_bytes += b.size;
        } else {
          std::free(ptr);
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
    events_.emplace(id, Event{device, nullptr, 0});
    return CudaEvent{device, reinterpret_cast<void*>(id)};
  }

  void destroy_event(CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    bool known;
    {
      absl::MutexLock lock(&mu_);
      known = events_.erase(reinterpret_cast<uintptr_t>(e.handle)) == 1;
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
    if (absl::StatusOr<Event> ev = event(e, "record"); !ev.ok()) return ev.status();
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
    // Never recorded, already passed, or the same stream (FIFO): nothing to hold back.
    if (!ev->stream || ev->stream == *st || ev->stream->passed(ev->ticket)) return absl::OkStatus();
    (*st)->enqueue([on = ev->stream, ticket = ev->ticket] { on->wait_passed(ticket); });
    return absl::OkStatus();
  }

  absl::Status synchronize(CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<Event> ev = event(e, "synchronize");
    if (!ev.ok()) return ev.status();
    if (ev->stream) ev->stream->wait_passed(ev->ticket);
    return absl::OkStatus();
  }

  absl::StatusOr<bool> query(CudaEvent e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<Event> ev = event(e, "query");
    if (!ev.ok()) return ev.status();
    return !ev->stream || ev->stream->passed(ev->ticket);
  }

  absl::Status synchronize(CudaStream s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<std::shared_ptr<EmulatedStream>> st = stream(s, "synchronize");
    if (!st.ok()) return st.status();
    (*st)->wait_passed((*st)->last_ticket());
    return absl::OkStatus();
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

}  // namespace ferry
