// File: agents/core/membership.h
//
// Membership: who is in the group right now — workers by name and by id, each with
// the address its transport publishes — versioned, and able to change while calls
// run. Readers take an immutable snapshot without a lock; writers build the next
// table and swap it in. Workers that left or were lost are remembered, so a call to
// one fails saying so instead of "unknown worker".
//
//   Membership members;
//   FERRY_RETURN_IF_ERROR(members.add({WorkerInfo{"worker1", 1}, "uv://10.0.0.2:4000"}));
//   std::shared_ptr<const Membership::Table> now = members.snapshot();
//   const Member* m = now->find(1);
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agents/rpc_agent.h"
#include "base/shared_slot.h"

namespace ferry {

// A worker and the address record its transport published (Transport::listen's;
// opaque to the core).
struct PeerAddress {
  WorkerInfo info;
  std::string address;
};

}  // namespace ferry

namespace ferry::internal {

using Member = PeerAddress;

// Thread-safe.
class Membership {
 public:
  // One version of the group. Immutable once published.
  struct Table {
    uint64_t version = 0;
    absl::flat_hash_map<int, Member> by_id;
    absl::flat_hash_map<std::string, int> ids_by_name;
    // Workers that were members once: name -> (id, why they went).
    absl::flat_hash_map<std::string, std::pair<int, MembershipChange>> departed;

    const Member* find(int id) const {
      auto it = by_id.find(id);
      return it == by_id.end() ? nullptr : &it->second;
    }
    const Member* find(std::string_view name) const;
    // Whether worker `id` was a member once and is gone.
    bool has_departed(int id) const;
    // Why worker `id` is not a member: kUnavailable when it left or was lost (saying
    // which), kNotFound when it was never known.
    absl::Status absent(int id) const;
    absl::Status absent(std::string_view name) const;
  };

  Membership();

  // The current table; never null.
  std::shared_ptr<const Table> snapshot() const { return table_.load(); }
  // The current table's version, without taking it: whether an entry taken from an
  // earlier snapshot is still current.
  uint64_t version() const { return version_.load(std::memory_order_acquire); }

  // Adds workers in one step (a static group's whole table at once). Errors
  // (kAlreadyExists), with nothing changed: a name or an id already a member, or used
  // twice in `members`.
  absl::Status add(std::vector<Member> members) ABSL_LOCKS_EXCLUDED(write_mu_);
  absl::Status add(Member member) { return add(std::vector<Member>{std::move(member)}); }

  // Removes worker `id`, remembering why; returns it. kNotFound if not a member.
  absl::StatusOr<Member> remove(int id, MembershipChange why) ABSL_LOCKS_EXCLUDED(write_mu_);

 private:
  absl::Mutex write_mu_;  // one writer at a time; readers load table_ without it
  SharedSlot<const Table> table_;
  std::atomic<uint64_t> version_{0};
};

}  // namespace ferry::internal
