// File: base/future.h
//
// Future<T> and Promise<T>: a value of type T (or an error) that arrives later,
// completed exactly once with absl::StatusOr<T>. The agents layer completes
// Future<Message> with replies; the rpc layer turns those into typed Future<R> for
// users.
//
//   Promise<int> promise;
//   Future<int> future = promise.get_future();
//   Future<std::string> text = future.then([](const absl::StatusOr<int>& v) {
//     return absl::StrCat(*v);                         // runs when the int arrives
//   });
//   promise.set_value(7);
//   std::string s = text.wait();                       // "7"; throws RpcError on error
//
// Threads: then() and add_callback() callbacks run on the thread that completes the
// future, or inline in the caller when the future is already complete, with one
// exception: a future made by an agent (an RPC reply) never runs them on a transport
// or timer thread; they run on the agent's worker pool instead, so a continuation may
// block and may itself call rpc_sync. Futures made by then() inherit that. Callbacks
// must not throw (an exception is logged and dropped). Callbacks run with no lock held.
#pragma once

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/progress.h"
#include "base/status.h"
#include "base/thread_role.h"

namespace ferry {

template <typename T>
class Future;
template <typename T>
class Promise;

namespace internal {

// A thread about to block on a result first polls for it, yielding the CPU between
// polls: a small RPC reply usually arrives within the window, and waking a sleeping
// thread costs several microseconds. From FERRY_SPIN_US (default 50; 0 turns polling
// off), and none while the host has more runnable threads than cores.

// FERRY_SPIN_US, read once (default 50).
std::chrono::microseconds configured_spin_window();
// Whether the host has clearly more runnable threads than cores (over 4 per core,
// sampled from the run queue every 20 ms at most): polling then takes a core that
// another thread needs.
bool host_crowded();

// Where a future's callbacks run when the completing thread must not run them.
class Executor {
 public:
  virtual ~Executor() = default;
  // Runs `task` later on another thread; false when no longer accepting work (the
  // caller then runs it itself).
  virtual bool post(std::function<void()> task) = 0;
};

// Runs a completion callback; an exception from it is logged and dropped, because it
// would otherwise escape onto a library thread.
void run_callback_guarded(const std::function<void()>& fn);

// How long a thread about to block first polls: configured_spin_window(). While the
// host is crowded, only a thread whose recent polls found what they waited for polls
// (a thread on a busy call path: a sleep and a wake-up would cost it and its waker
// more than the poll), and the others poll only now and then, to find out whether
// polling pays off again: a poll that finds nothing takes a core another thread needs.
//
// The window itself adapts per thread: a wait whose poll missed but that ended soon
// after (a round trip a little longer than the window, as over TCP) widens it, up to
// kMaxSpinWindow; a wait that ended long after narrows it back towards the configured
// window. An idle thread polls at most one window before it sleeps.
std::chrono::microseconds spin_window();
inline constexpr std::chrono::microseconds kMaxSpinWindow{1000};

// A poll window that learns, as above. Each thread has one; threads that take turns at
// the same wait (a pool's poller) share one, so that what one learned the next uses.
// Thread-safe.
class PollWindow {
 public:
  // The learned window, crowding aside: configured_spin_window() at first.
  std::chrono::microseconds get() const;
  // A wait whose poll missed lasted `waited` in all.
  void missed_wait(std::chrono::steady_clock::duration waited);

 private:
  mutable std::atomic<int64_t> us_{-1};
};
// The calling thread's own window.
PollWindow& thread_poll_window();
// spin_window() for a shared window.
std::chrono::microseconds spin_window(const PollWindow& window);
// Records, for the calling thread, whether a poll found what it waited for.
void note_spin(bool found);
// Records, for the calling thread's own window, how long in all a wait lasted whose
// poll missed.
inline void note_missed_wait(std::chrono::steady_clock::duration waited) { thread_poll_window().missed_wait(waited); }

// The first polls of a wait only pause the core between them: what is a microsecond
// away is seen at once, where a yield (a system call, and on a loaded host the rest
// of a time slice given away) costs more than that. Later polls yield.
inline constexpr int kPausingPolls = 64;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Yields the core, noting whether that gave it to another thread: a yield that comes
// back after kSharedYield ran someone else meanwhile (alone, a yield takes about
// 0.2 us). Then the calling thread shares its core with a runnable thread.
inline constexpr std::chrono::nanoseconds kSharedYield{500};
void yield_core();
// Whether the calling thread's last yield_core() ran another thread. Two pollers of one
// round trip on one core (a 2-core host whose other core is taken) then see nothing
// while they pause: only a yield lets the other side run. Pausing first made a small
// call 7-8 us there instead of 2-3 (ferry bench rpc, now and then).
bool core_shared();

// Between two polls of a wait, the `polls`-th empty one: a pause for the first
// kPausingPolls, unless the core is shared, else a yield. True when the wait should
// read the clock now: after every yield, and every eighth pause (a clock read costs
// as much as a few pauses, and a poll that reads it sees a reply later).
inline bool between_polls(int polls) {
  if (polls <= kPausingPolls && !core_shared()) {
    cpu_relax();
    return polls % 8 == 0;
  }
  yield_core();
  return true;
}

// Polls `ready` for at most `window`, yielding between polls (`pausing`: pausing
// between the first ones, for a poller with a core of its own to spare; with
// TensorPipe's shm reactors polling beside it, pausing took their cores: ferry's
// small call on shm went from 11 to 14 us); true if it became true.
template <typename Ready>
bool spin_until(Ready ready, std::chrono::microseconds window = spin_window(), bool pausing = false) {
  if (window.count() == 0) return false;
  auto until = std::chrono::steady_clock::now() + window;
  int polls = 0;
  for (;;) {
    if (ready()) {
      note_spin(true);
      return true;
    }
    if (pausing) {
      if (!between_polls(++polls)) continue;
    } else {
      yield_core();
    }
    if (std::chrono::steady_clock::now() >= until) break;
  }
  bool found = ready();
  note_spin(found);
  return found;
}

// spin_until, driving every registered transport (base/progress.h) between polls, so
// that what the caller waits for may arrive through the caller's own thread. Without
// a registered transport, or nested in a poll, it is spin_until.
template <typename Ready>
bool drive_until(Ready ready, std::chrono::microseconds window = spin_window()) {
  if (window.count() == 0 || driving_progress()) return spin_until(ready, window);
  const std::vector<std::shared_ptr<Progress>>& progress = registered_progress();
  if (progress.empty()) return spin_until(ready, window);
  set_driving_progress(true);
  for (const std::shared_ptr<Progress>& p : progress) p->enter();
  auto until = std::chrono::steady_clock::now() + window;
  bool found = false;
  int empty_polls = 0;
  for (;;) {
    if (ready()) {
      found = true;
      break;
    }
    bool moved = false;
    for (const std::shared_ptr<Progress>& p : progress) moved |= p->poll();
    // While polls move work the window does not run out: the thread is doing what
    // the data thread would (and a clock read per message cost a caller with 256
    // calls in flight a sixth of its time).
    if (moved) continue;
    if (between_polls(++empty_polls) && std::chrono::steady_clock::now() >= until) break;
  }
  // A pool thread that found a task steps away to run it (an agent thread's wait for
  // a reply inside a handler also counts: it runs the rest of the handler); a user's
  // thread that found its reply may do anything next, for as long as it likes.
  const bool returns = found && on_agent_thread();
  for (const std::shared_ptr<Progress>& p : progress) returns ? p->step_away() : p->leave();
  set_driving_progress(false);
  if (!found) found = ready();
  note_spin(found);
  return found;
}

template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {
  using value_type = T;
};

// The shared state of a promise and its futures. Thread-safe.
template <typename T>
class FutureState : public std::enable_shared_from_this<FutureState<T>> {
 public:
  // Move-only, and kept in place up to two pointers: a call's decoding step (a promise
  // and an empty lambda) costs no allocation, where std::function allocated one.
  using Callback = absl::AnyInvocable<void(const absl::StatusOr<T>&)>;

  FutureState() = default;
  explicit FutureState(std::weak_ptr<Executor> executor) : executor_(std::move(executor)) {}

  const std::weak_ptr<Executor>& executor() const { return executor_; }

  // Returns false when already complete (the second completion is dropped).
  bool complete(absl::StatusOr<T> result) {
    Entries callbacks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (result_.has_value()) return false;
      result_.emplace(std::move(result));
      callbacks.swap(callbacks_);
      ready_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
    if (callbacks.empty()) return true;
    std::vector<Callback> deferred;
    const bool defer = on_transport_thread() && !executor_.expired();
    for (Entry& e : callbacks) {
      if (e.inline_ok || !defer) {
        run_callback_guarded([&] { e.fn(*result_); });
      } else {
        deferred.push_back(std::move(e.fn));
      }
    }
    if (!deferred.empty()) {
      // Shared: Executor::post takes a std::function, which must be copyable.
      auto run = [self = this->shared_from_this(),
                  deferred = std::make_shared<std::vector<Callback>>(std::move(deferred))] {
        for (Callback& cb : *deferred) run_callback_guarded([&] { cb(*self->result_); });
      };
      std::shared_ptr<Executor> executor = executor_.lock();
      if (executor == nullptr || !executor->post(run)) run();
    }
    return true;
  }

  // `inline_ok`: fn is short and never blocks, so it may run on any thread.
  void add_callback(Callback cb, bool inline_ok = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!result_.has_value()) {
        callbacks_.push_back(Entry{std::move(cb), inline_ok});
        return;
      }
    }
    run_callback_guarded([&] { cb(*result_); });
  }

  bool ready() const { return ready_.load(std::memory_order_acquire); }

  // True when complete before the deadline.
  bool wait(std::optional<std::chrono::milliseconds> timeout) {
    if (ready()) return true;
    const std::chrono::microseconds window = spin_window();
    if (drive_until([this] { return ready(); }, window)) return true;
    // The wait began about a window ago: the clock is read only when the poll missed.
    auto start = std::chrono::steady_clock::now() - window;
    std::unique_lock<std::mutex> lock(mu_);
    auto done = [this] { return result_.has_value(); };
    bool arrived = true;
    if (!timeout.has_value()) {
      cv_.wait(lock, done);
    } else {
      arrived = cv_.wait_for(lock, *timeout, done);
    }
    if (arrived) note_missed_wait(std::chrono::steady_clock::now() - start);
    return arrived;
  }

  // Precondition: ready(). The result never changes once set, so no lock is needed.
  const absl::StatusOr<T>& result() const { return *result_; }

 private:
  // std::mutex, not absl::Mutex, on this per-call path: with Debian's shared Abseil
  // (every lock a call into the library, waits through Await) a small call measured
  // 3-4 us slower (docs/performance.md). TSan sees pthread mutexes natively; the
  // thread-safety analysis does not cover this one.
  std::mutex mu_;  // guards callbacks_ and the setting of result_
  std::condition_variable cv_;
  std::atomic<bool> ready_{false};
  struct Entry {
    Callback fn;
    bool inline_ok;
  };
  const std::weak_ptr<Executor> executor_{};
  // Set once, under mu_ and before ready_; read without the lock once ready() (it never
  // changes again), so it carries no ABSL_GUARDED_BY.
  std::optional<absl::StatusOr<T>> result_;
  // Nearly every future has one callback at most (a call's decoding step): kept in
  // place, it costs no allocation per call.
  using Entries = absl::InlinedVector<Entry, 1>;
  Entries callbacks_;
};

}  // namespace internal

// A handle to a result that arrives later. Copies share the same state. Thread-safe.
template <typename T>
class Future {
 public:
  using value_type = T;

  // An invalid future (valid() is false); only assignment and valid() may be used.
  Future() = default;

  bool valid() const { return state_ != nullptr; }
  // Whether the result has arrived.
  bool is_ready() const { return state_->ready(); }

  // Waits for the result, at most `timeout` (none: forever); kDeadlineExceeded if the
  // timeout passes first (the call itself goes on). Never throws.
  absl::Status wait_for(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const {
    if (!state_->wait(timeout)) {
      return absl::DeadlineExceededError(
          absl::StrCat("future not complete after waiting ", timeout->count(), " ms"));
    }
    return state_->result().status();
  }

  // Waits for the result and returns it, or throws RpcError with its error status
  // (or kDeadlineExceeded when `timeout` passes first).
  T wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const {
    if (!state_->wait(timeout)) {
      throw RpcError(absl::DeadlineExceededError(
          absl::StrCat("future not complete after waiting ", timeout->count(), " ms")));
    }
    const absl::StatusOr<T>& r = state_->result();
    if (!r.ok()) throw RpcError(r.status());
    return *r;
  }

  // The result; blocks until it arrives. Never throws.
  const absl::StatusOr<T>& result() const {
    state_->wait(std::nullopt);
    return state_->result();
  }
  // The value (throws RpcError on error); blocks until it arrives.
  T value() const { return wait(); }
  // The status; blocks until the result arrives.
  absl::Status status() const { return result().status(); }

  // Runs `fn(const absl::StatusOr<T>&)` when the result arrives (see the file comment
  // for the thread). Errors reach fn too.
  void add_callback(std::function<void(const absl::StatusOr<T>&)> fn) const {
    state_->add_callback(std::move(fn));
  }
  // Like add_callback, but fn may run on any thread, a transport thread included: for
  // bookkeeping that is short and never blocks (the agent's call statistics).
  void add_inline_callback(std::function<void(const absl::StatusOr<T>&)> fn) const {
    state_->add_callback(std::move(fn), /*inline_ok=*/true);
  }

  // A future of fn's result: fn takes const absl::StatusOr<T>& and returns U, or
  // absl::StatusOr<U>.
  // An exception thrown by fn becomes the returned future's kUnknown error.
  template <typename F>
  auto then(F&& fn) const;

  // then() for a continuation that is short and never blocks (decoding a reply): it
  // runs on whichever thread completes this future, even a transport thread. The
  // returned future still keeps user callbacks off transport threads.
  template <typename F>
  auto then_inline(F&& fn) const;

 private:
  template <typename F>
  auto chain(F&& fn, bool inline_ok) const;

  friend class Promise<T>;
  template <typename U>
  friend class Future;
  explicit Future(std::shared_ptr<internal::FutureState<T>> state) : state_(std::move(state)) {}

  std::shared_ptr<internal::FutureState<T>> state_;
};

// The writing side of a Future. Thread-safe; completing twice keeps the first result.
template <typename T>
class Promise {
 public:
  Promise() : state_(std::make_shared<internal::FutureState<T>>()) {}
  // A promise whose future's callbacks run on `executor` when completed on a transport
  // thread (see the file comment).
  explicit Promise(std::weak_ptr<internal::Executor> executor)
      : state_(std::make_shared<internal::FutureState<T>>(std::move(executor))) {}

  Future<T> get_future() const { return Future<T>(state_); }
  // Returns false when the future was already complete.
  bool set_value(T value) const { return state_->complete(absl::StatusOr<T>(std::move(value))); }
  bool set_error(absl::Status status) const { return state_->complete(absl::StatusOr<T>(std::move(status))); }
  bool set_result(absl::StatusOr<T> result) const { return state_->complete(std::move(result)); }
  bool is_complete() const { return state_->ready(); }

 private:
  std::shared_ptr<internal::FutureState<T>> state_;
};

// A future that is already complete.
template <typename T>
Future<T> make_ready_future(absl::StatusOr<T> result) {
  Promise<T> p;
  p.set_result(std::move(result));
  return p.get_future();
}

template <typename T>
template <typename F>
auto Future<T>::then(F&& fn) const {
  return chain(std::forward<F>(fn), /*inline_ok=*/false);
}

template <typename T>
template <typename F>
auto Future<T>::then_inline(F&& fn) const {
  return chain(std::forward<F>(fn), /*inline_ok=*/true);
}

template <typename T>
template <typename F>
auto Future<T>::chain(F&& fn, bool inline_ok) const {
  using Raw = std::invoke_result_t<F, const absl::StatusOr<T>&>;
  using U = std::conditional_t<internal::IsStatusOr<Raw>::value, typename internal::IsStatusOr<Raw>::value_type,
                               Raw>;
  static_assert(!std::is_void_v<U>, "then(): the continuation must return a value or a StatusOr");
  // A struct rather than a lambda: an empty fn then takes no room, and the whole fits
  // the callback's in-place storage.
  struct Continuation {
    Promise<U> promise;
    [[no_unique_address]] std::decay_t<F> fn;
    void operator()(const absl::StatusOr<T>& r) {
      try {
        promise.set_result(absl::StatusOr<U>(fn(r)));
      } catch (const std::exception& e) {
        promise.set_error(absl::UnknownError(absl::StrCat("then() continuation threw: ", e.what())));
      } catch (...) {
        promise.set_error(absl::UnknownError("then() continuation threw a non-standard exception"));
      }
    }
  };
  Promise<U> promise(state_->executor());
  Future<U> out = promise.get_future();
  state_->add_callback(Continuation{std::move(promise), std::forward<F>(fn)}, inline_ok);
  return out;
}

}  // namespace ferry
