// File: agents/core/join_barrier.h
//
// JoinBarrier: how one agent's workers finish together (RpcAgent::join) and what the
// agent knows of peers that were lost meanwhile. join() rounds run through the store
// only: every worker is accounted for once under the round's keys, by itself when it
// arrives or by any worker that saw it lost; the claim that accounts for the last sets
// "done". A worker 0 that usually hosts the store leaves last.
//
// It also keeps the fates of a static group's lost members (a call to one fails at
// once with why), and decides whether a peer that goes was lost or left: once a round
// saw everyone arrive, peers that go now leave; while a round waits, a loss is
// accounted in the store and told once it is known.
//
// It calls only the store and reads the membership. Threads: any; join() on the user's
// thread that shuts down, the rest from transport, timer and pool threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/core/lock_order.h"
#include "agents/core/membership.h"
#include "store/store.h"

namespace ferry::internal {

class JoinBarrier {
 public:
  // `store` and `members` outlive it; round keys go under `prefix` + "join/<n>/".
  JoinBarrier(WorkerInfo self, Store& store, const Membership& members, std::string prefix,
              std::chrono::milliseconds heartbeat);

  // ---- Lost peers.
  // Why worker `id` is gone, if it is a lost or retiring member.
  std::optional<absl::Status> lost_status(int id) const;
  // Records that `peer` was lost; whether this was the first time.
  bool record_loss(int peer, absl::Status why);
  // A member that is leaving: calls to it fail at once with `why`.
  void retire(int id, absl::Status why);
  void forget(int id);
  // Once a round saw everyone arrive: a peer that goes now left.
  bool departing() const { return departing_.load(); }
  // What to tell of a member first recorded lost: kLeft or kLost now, or nothing yet
  // while a round waits. Then the waiting thread accounts the loss in the store at its
  // next wake, unless the round ends first, and end_wait() tells it. Peers that saw the
  // round end leave while slower workers still wait: accounting those on other threads
  // opened a second store connection per worker, all at once.
  std::optional<MembershipChange> decide(const WorkerInfo& lost);

  // ---- join().
  struct Round {
    std::string prefix;
    int size = 0;
  };
  // The next round, for a group of `size` workers.
  Round begin(int size);
  // Arrives and waits until every worker is accounted for. A worker that never arrives
  // and that nobody has a connection to is probed (`probe(id)`, which pings it): soon
  // by the first to arrive, later by the others too. kUnavailable when another worker
  // had recorded this one lost before it arrived: it is not part of the round.
  absl::Status wait(const Round& round, std::chrono::steady_clock::time_point deadline,
                    const std::function<void(int)>& probe);
  // Ends the wait: the losses deferred while it ran, and whether each left (it arrived)
  // or was lost.
  std::vector<std::pair<WorkerInfo, MembershipChange>> end_wait(const Round& round, const absl::Status& waited);
  // How many workers arrived in the round.
  absl::StatusOr<int64_t> arrived(const Round& round);
  // Leaves the round (worker 0 waits for every other to leave first), then says which
  // workers were lost, if `arrived` falls short of the round's size.
  absl::Status leave(const Round& round, int64_t arrived, std::chrono::steady_clock::time_point deadline);

 private:
  // Which workers of the round were lost, as the error leave() returns; OK, with
  // `arrived` set to the round's size, when every worker's fate says it arrived (the
  // last had claimed its fate and not yet counted itself when `arrived` was read).
  absl::Status lost_in(const Round& round, int64_t& arrived, std::chrono::steady_clock::time_point deadline);
  // Claims the fate of worker `id` ("arrived" for itself, else "lost") once per round;
  // the claim that accounts for the last worker sets "done". The order of this worker's
  // arrival (1: first) for its own claim, else 0; kUnavailable when its own claim finds
  // it already recorded lost.
  absl::StatusOr<int64_t> account(const std::string& prefix, int id, bool arrived, int n);

  const WorkerInfo self_;
  Store& store_;
  const Membership& members_;
  const std::string prefix_;
  const std::chrono::milliseconds heartbeat_;

  mutable RankedMutex mu_{LockRank::kFates};
  absl::flat_hash_map<int, absl::Status> lost_ ABSL_GUARDED_BY(mu_);
  std::vector<WorkerInfo> deferred_ ABSL_GUARDED_BY(mu_);
  std::vector<int> unaccounted_ ABSL_GUARDED_BY(mu_);  // deferred losses the round has not counted
  std::atomic<bool> any_lost_{false};
  std::atomic<bool> waiting_{false};
  // Set under mu_ as a wait ends, so that decide() never calls lost a peer that left
  // just as this worker's round ended.
  std::atomic<bool> departing_{false};
  std::atomic<int> generation_{0};
};

}  // namespace ferry::internal
