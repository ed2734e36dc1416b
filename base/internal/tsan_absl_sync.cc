// ThreadSanitizer builds only (FERRY_SANITIZE=thread): makes Debian's Abseil
// synchronization primitives, and absl::Status's shared count, visible to TSan.
//
// Debian's libabsl_synchronization is not built with -fsanitize=thread, so absl::Mutex's
// lock and unlock are plain atomics and futex calls TSan never sees: every access guarded
// by an absl::Mutex would be reported as a data race. This file defines, in each
// executable of a TSan build, the out-of-line members of absl::Mutex, absl::CondVar and
// absl::Notification that ferry calls. Each one tells TSan what it does with the mutex
// annotation interface (sanitizer/tsan_interface.h) and then calls the library's own
// definition, found with dlsym(RTLD_NEXT). A definition in the executable takes
// precedence over the shared library's, as an interceptor's does.
//
// Memory accesses between a pre_ and its post_ annotation are ignored by TSan; Abseil
// evaluates absl::Condition callbacks inside Lock/Unlock/Await, so accesses made by a
// condition are not checked (they read state the condition's mutex guards, which
// -Wthread-safety checks). Everything else ferry does under an absl::Mutex is.
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TSAN_ABSL_SYNC 1
#endif
#endif

#ifdef FERRY_TSAN_ABSL_SYNC

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "absl/base/options.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define FERRY_STR2(x) #x
#define FERRY_STR(x) FERRY_STR2(x)

// The Itanium-mangled name of absl::<inline namespace>::<rest>; `nk` is "N" or "NK"
// (a const member function).
std::string mangled(const char* nk, const char* rest) {
  const char* ns = FERRY_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return std::string("_Z") + nk + "4absl" + std::to_string(std::strlen(ns)) + ns + rest;
}

void* real(const char* nk, const char* rest) {
  const std::string name = mangled(nk, rest);
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "ferry tsan_absl_sync: %s not found in Abseil's libraries\n", name.c_str());
    std::abort();
  }
  return fn;
}

template <typename Fn>
Fn real_fn(const char* nk, const char* rest) {
  return reinterpret_cast<Fn>(real(nk, rest));
}

// Abseil calls its own members too (AwaitWithTimeout calls AwaitWithDeadline, and the
// executable's definitions interpose on those calls): only the outermost call on a
// thread is annotated.
thread_local int depth = 0;

class Outermost {
 public:
  Outermost() : outer_(depth++ == 0) {}
  ~Outermost() { --depth; }
  Outermost(const Outermost&) = delete;
  Outermost& operator=(const Outermost&) = delete;
  bool operator()() const { return outer_; }

 private:
  const bool outer_;
};

// Waits that give the mutex up and take it back: TSan sees a release before and an
// acquire after; the wait itself (and conditions it evaluates) sits in the lock's
// pre/post window.
template <typename F>
auto release_wait_acquire(void* mu, unsigned flags, F&& wait) {
  Outermost outer;
  if (!outer()) return wait();
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  auto r = wait();
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

// Lock-type calls: pre_lock, the call, post_lock (flags from the result for a try).
template <typename F>
auto annotate_lock(void* mu, unsigned flags, F&& call) {
  Outermost outer;
  if (!outer()) return call();
  __tsan_mutex_pre_lock(mu, flags);
  auto r = call();
  if constexpr (std::is_same_v<decltype(r), bool>) {
    if ((flags & __tsan_mutex_try_lock) != 0 && !r) flags |= __tsan_mutex_try_lock_failed;
  }
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

template <typename F>
void annotate_unlock(void* mu, unsigned flags, F&& call) {
  Outermost outer;
  if (!outer()) return call();
  __tsan_mutex_pre_unlock(mu, flags);
  call();
  __tsan_mutex_post_unlock(mu, flags);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

Mutex::~Mutex() {
  static auto fn = real_fn<void (*)(Mutex*)>("N", "5MutexD2Ev");
  __tsan_mutex_destroy(this, 0);
  fn(this);
}

void Mutex::Lock() {
  static auto fn = real_fn<void (*)(Mutex*)>("N", "5Mutex4LockEv");
  annotate_lock(this, 0, [&] { return fn(this), 0; });
}

void Mutex::ReaderLock() {
  static auto fn = real_fn<void (*)(Mutex*)>("N", "5Mutex10ReaderLockEv");
  annotate_lock(this, __tsan_mutex_read_lock, [&] { return fn(this), 0; });
}

bool Mutex::TryLock() {
  static auto fn = real_fn<bool (*)(Mutex*)>("N", "5Mutex7TryLockEv");
  return annotate_lock(this, __tsan_mutex_try_lock, [&] { return fn(this); });
}

bool Mutex::ReaderTryLock() {
  static auto fn = real_fn<bool (*)(Mutex*)>("N", "5Mutex13ReaderTryLockEv");
  return annotate_lock(this, __tsan_mutex_try_read_lock, [&] { return fn(this); });
}

void Mutex::Unlock() {
  static auto fn = real_fn<void (*)(Mutex*)>("N", "5Mutex6UnlockEv");
  annotate_unlock(this, 0, [&] { fn(this); });
}

void Mutex::ReaderUnlock() {
  static auto fn = real_fn<void (*)(Mutex*)>("N", "5Mutex12ReaderUnlockEv");
  annotate_unlock(this, __tsan_mutex_read_lock, [&] { fn(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  static auto fn = real_fn<void (*)(Mutex*, const Condition&)>("N", "5Mutex8LockWhenERKNS0_9ConditionE");
  annotate_lock(this, 0, [&] { return fn(this, cond), 0; });
}

// Held on return either way.
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static auto fn = real_fn<bool (*)(Mutex*, const Condition&, Duration)>(
      "N", "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return annotate_lock(this, 0, [&] { return fn(this, cond, timeout); });
}

void Mutex::Await(const Condition& cond) {
  static auto fn = real_fn<void (*)(Mutex*, const Condition&)>("N", "5Mutex5AwaitERKNS0_9ConditionE");
  release_wait_acquire(this, 0, [&] {
    fn(this, cond);
    return 0;
  });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static auto fn = real_fn<bool (*)(Mutex*, const Condition&, Duration)>(
      "N", "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return release_wait_acquire(this, 0, [&] { return fn(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static auto fn = real_fn<bool (*)(Mutex*, const Condition&, Time)>(
      "N", "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return release_wait_acquire(this, 0, [&] { return fn(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  static auto fn = real_fn<void (*)(CondVar*, Mutex*)>("N", "7CondVar4WaitEPNS0_5MutexE");
  release_wait_acquire(mu, 0, [&] {
    fn(this, mu);
    return 0;
  });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static auto fn = real_fn<bool (*)(CondVar*, Mutex*, Duration)>(
      "N", "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return release_wait_acquire(mu, 0, [&] { return fn(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static auto fn = real_fn<bool (*)(CondVar*, Mutex*, Time)>(
      "N", "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return release_wait_acquire(mu, 0, [&] { return fn(this, mu, deadline); });
}

// Notify publishes everything written before it to whoever sees the notification.
void Notification::Notify() {
  static auto fn = real_fn<void (*)(Notification*)>("N", "12Notification6NotifyEv");
  __tsan_release(this);
  fn(this);
}

void Notification::WaitForNotification() const {
  static auto fn = real_fn<void (*)(const Notification*)>("NK", "12Notification19WaitForNotificationEv");
  fn(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static auto fn = real_fn<bool (*)(const Notification*, Duration)>(
      "NK", "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool r = fn(this, timeout);
  if (r) __tsan_acquire(const_cast<Notification*>(this));
  return r;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static auto fn = real_fn<bool (*)(const Notification*, Time)>(
      "NK", "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool r = fn(this, deadline);
  if (r) __tsan_acquire(const_cast<Notification*>(this));
  return r;
}

// A Status with a message shares one heap rep among its copies, counted with atomics
// inside libabsl_status, which TSan never sees: a copy read on one thread and the last
// copy dropped on another (the rep freed) looked like a race. Every drop publishes what
// its thread did, and takes in what earlier drops published, so the one that frees the
// rep comes after every reader, as the count's acquire-release makes it.
void Status::UnrefNonInlined(uintptr_t rep) {
  static auto fn = real_fn<void (*)(uintptr_t)>("N", "6Status15UnrefNonInlinedEm");
  void* shared = reinterpret_cast<void*>(rep);
  __tsan_release(shared);
  __tsan_acquire(shared);
  fn(rep);
}

ABSL_NAMESPACE_END
}  // namespace absl

#endif  // FERRY_TSAN_ABSL_SYNC
