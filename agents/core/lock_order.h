// File: agents/core/lock_order.h
//
// The agent core's locks, and the one order in which a thread may take them. Every
// mutex of the core is a RankedMutex named by a rank below; a thread that holds one
// takes another only of a higher rank. The ranks are the order:
//
//   kListeners   Agent: held while membership listeners run (they may call anything)
//   kHooks       Agent: the control handler and the custom join
//   kChanges     Agent: membership changes waiting for delivery
//   kFates       JoinBarrier: lost peers, and the barrier a loss is accounted in
//   kWatch       Liveness: watched peers
//   kPinging     Liveness: peers with a heartbeat ping out
//   kLinks       Links: this worker's calls' connections, by peer
//   kAccepted    Links: connections peers opened, by the id they proved
//   kFlow        Session::flow_mu: pause, resume and sharing of one connection
//   kSession     Session::mu: what waits to go out on one connection
//
// Below them come the call table's lock (agents/core/call_table.h; Session::mu is held
// across CallTable::deadline_of) and the transports' own, which call nothing of the
// core while held. No lock of the core is held while user code runs, except
// kListeners, and none while a transport's connect() or close() runs.
//
// Checked three ways: clang's -Wthread-safety (the TSan build of `make test`) checks
// that what a lock guards is touched only under it; debug builds (NDEBUG unset: the
// ASan build) check every acquisition against the ranks the thread holds and abort
// naming both; ThreadSanitizer reports an inversion it sees at run time.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ferry::internal {

enum class LockRank : int {
  kListeners = 1,
  kHooks,
  kChanges,
  kFates,
  kWatch,
  kPinging,
  kLinks,
  kAccepted,
  kFlow,
  kSession,
};

const char* lock_rank_name(LockRank rank);

// Debug builds: records that this thread takes / released a lock of `rank`; aborts,
// naming both, when it already holds one of the same or a higher rank.
void lock_rank_enter(LockRank rank);
void lock_rank_leave(LockRank rank);

// An absl::Mutex with its rank in the core's lock order.
class ABSL_LOCKABLE RankedMutex {
 public:
  explicit RankedMutex(LockRank rank) : rank_(rank) {}
  RankedMutex(const RankedMutex&) = delete;
  RankedMutex& operator=(const RankedMutex&) = delete;

  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
#ifndef NDEBUG
    lock_rank_enter(rank_);
#endif
    mu_.Lock();
  }
  void unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.Unlock();
#ifndef NDEBUG
    lock_rank_leave(rank_);
#endif
  }
  void assert_held() const ABSL_ASSERT_EXCLUSIVE_LOCK() { mu_.AssertHeld(); }

 private:
  absl::Mutex mu_;
  [[maybe_unused]] const LockRank rank_;  // checked in debug builds only
};

// Holds a RankedMutex for its scope.
class ABSL_SCOPED_LOCKABLE Locked {
 public:
  explicit Locked(RankedMutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_.lock(); }
  ~Locked() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

 private:
  RankedMutex& mu_;
};

}  // namespace ferry::internal
