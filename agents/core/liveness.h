// File: agents/core/liveness.h
//
// Liveness: finding peers that stopped without closing their connections. A peer with
// calls pending that sent nothing for a heartbeat is pinged (CallTable's heartbeat
// hook calls suspect()); so is every watched peer (RpcAgent::watch) that sent nothing
// for half a heartbeat. A ping not answered in time, with nothing else heard from the
// peer since it went, makes the peer lost: its link is dropped and the agent is told.
//
// It calls only what is below it (the outbox for pings, the links, the call table's
// clock and timer) and reports upward through one callback.
//
// Threads: any; `lost` runs on a pool thread (a ping's completion).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "agents/core/lock_order.h"

namespace ferry::internal {

class CallTable;
class Links;
class Membership;
class Outbox;

class Liveness {
 public:
  Liveness(std::string self_name, int self_id, std::chrono::milliseconds heartbeat, Outbox& outbox, Links& links,
           CallTable& calls, const Membership& members, std::weak_ptr<void> owner,
           std::function<void(int, absl::Status)> lost);

  // Pings `peer`; one that does not answer within `wait` (and sent nothing since) is
  // lost. One ping per peer at a time.
  void suspect(int peer, std::chrono::milliseconds wait);
  // Every half heartbeat, pings each watched peer that sent nothing meanwhile. Off when
  // the heartbeat is zero.
  void watch(int peer, bool watched);
  // No more checks of watched peers.
  void stop() { stopped_.store(true); }

 private:
  // The watch's timer task: suspects every watched peer, and comes back while any is.
  void check_watched();

  const std::string self_name_;
  const int self_id_;
  const std::chrono::milliseconds heartbeat_;
  Outbox& outbox_;
  Links& links_;
  CallTable& calls_;
  const Membership& members_;
  const std::weak_ptr<void> owner_;
  const std::function<void(int, absl::Status)> lost_;
  std::atomic<bool> stopped_{false};

  RankedMutex watch_mu_{LockRank::kWatch};
  absl::flat_hash_set<int> watched_ ABSL_GUARDED_BY(watch_mu_);
  bool watching_ ABSL_GUARDED_BY(watch_mu_) = false;  // check_watched() is scheduled
  RankedMutex pinging_mu_{LockRank::kPinging};
  absl::flat_hash_set<int> pinging_ ABSL_GUARDED_BY(pinging_mu_);
};

}  // namespace ferry::internal
