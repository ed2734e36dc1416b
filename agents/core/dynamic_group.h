// File: agents/core/dynamic_group.h (not installed)
//
// The TENSORPIPE init handler's dynamic groups (DESIGN.md, "Dynamic group"; seed 002):
// workers join and leave a running group, one at a time, under a lock in the store.
//
// Join: take the lock; read the member list from the store; refuse a duplicate name or
// rank; fetch every member's device info over RPC, all at once within half the time
// left (a member that is unreachable or does not answer in time is lost and dropped:
// it would hold up every later join); validate every map with is_static_group = false;
// send every member (and apply to itself) an update: the joiner's info and address,
// that member's new reverse maps and devices (one that does not answer is dropped
// too); publish the new list; release the lock.
// Leave (shutdown): take the lock; tell every member at once, which stops new calls to
// the leaver, lets its calls in flight finish (the leaver serves them meanwhile), and
// removes it (kLeft); then refuse stray requests, finish serving and this worker's own
// calls; publish the list; release the lock. Under steady traffic it takes about the
// longest call in flight. A worker that hosts the store in its process may
// leave only last: while others remain its leave is refused (kFailedPrecondition) and
// it keeps running.
//
// The lock is a lease (agents/core/membership_lock.h): its holder renews it from its
// own thread, a waiter that gives up touches nothing, and a holder that stops renewing
// (stopped, hung) loses it a lease later. The list is published only while the lock is
// still held and only over the list that was read (compare_set), so a holder that
// stalled past its lease never overwrites its successor's list.
#pragma once

#include <chrono>
#include <memory>

#include "absl/status/status.h"
#include "agents/core/agent.h"
#include "device_maps/validate.h"
#include "store/store.h"

namespace ferry {

// Joins `agent` (started, listening, no members) to the dynamic group in `store`, as
// the worker `mine` describes (its name, device count, maps and devices; the agent's
// id is its rank). On success the agent serves the membership protocol and leaves on
// join(). Errors, with the group unchanged: kFailedPrecondition for a transport that
// cannot reach workers that join later (a process group's fixed mesh), a name or rank
// already in use (naming it), the validator's message for bad device maps,
// kDeadlineExceeded waiting for the lock (naming its holder), kAborted when this worker
// lost the lock while joining (it stalled past the lease).
absl::Status join_dynamic_group(const std::shared_ptr<Agent>& agent, std::shared_ptr<Store> store,
                                WorkerDeviceInfo mine, std::chrono::milliseconds timeout);

}  // namespace ferry
