// File: agents/core/membership_lock.h (not installed)
//
// MembershipLock: the dynamic group's lock (agents/core/dynamic_group.h), a lease on
// one store key. The holder writes its name and a nonce there with compare_set and
// renews the lease from its own thread; a waiter that sees the value unchanged for a
// whole lease takes it over (the holder stopped or hung). A waiter that gives up
// touches nothing, so a lock never has two holders while its holder is alive and
// renewing. Every value is written with compare_set_owned: where the store has leases
// (Store::has_leases), a holder that dies frees the lock within the store's lease TTL,
// and waiters take it at once, without waiting out a lease of their own measure.
//
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<MembershipLock> lock,
//       MembershipLock::acquire(store, "ferry/rpc/dynamic/lock", "worker3", seconds(30)));
//   ... read, change and write what the lock guards, checking lock->held() before
//   ... each write; the destructor releases it.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "store/store.h"

namespace ferry::internal {

// Thread-safe. Holds the store (shared) and a thread that renews the lease until
// release() or destruction.
class MembershipLock {
 public:
  static constexpr std::chrono::milliseconds kDefaultLease{std::chrono::seconds(10)};

  // Takes the lock at `key` for `owner` (named in other waiters' errors), waiting at
  // most `timeout`. A holder that has not renewed its lease for `lease` (measured by
  // this waiter) is taken over, with a warning naming it. Errors: kDeadlineExceeded
  // naming the holder; the store's.
  static absl::StatusOr<std::unique_ptr<MembershipLock>> acquire(std::shared_ptr<Store> store, std::string key,
                                                                 std::string owner, std::chrono::milliseconds timeout,
                                                                 std::chrono::milliseconds lease = kDefaultLease);
  ~MembershipLock();  // release()
  MembershipLock(const MembershipLock&) = delete;
  MembershipLock& operator=(const MembershipLock&) = delete;

  // OK while this holder still has the lock (renewing it now); kAborted once another
  // worker took it over (this one stalled for a whole lease), saying so.
  absl::Status held();
  // Stops renewing and frees the key if this holder still has it. Idempotent.
  void release();

  struct State;

 private:
  explicit MembershipLock(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace ferry::internal
