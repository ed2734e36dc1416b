// File: agents/core/departures.h (not installed)
//
// Departures: learning from the store that a member died. Where the store has leases
// (Store::has_leases, EtcdStore), every member keeps a record under its own lease
// (Store::set_owned); the store drops it within its lease TTL of the member's death,
// without anyone probing. This watch (one thread, one store watch, no polling) sees a
// record vanish and reports its member once through `gone`, which the agent treats as it
// treats a failed connection (Agent::on_peer_lost): one notion of "gone", however it was
// found. A member that leaves on purpose is unwatched first (remove()), and one that is
// reported here after its leave was seen is counted as left by the same path.
//
//   DepartureWatch watch(store, "worker0", [&](int id, absl::Status why) { ... });
//   watch.add(3, "worker3", "ferry/rpc/alive/3");
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "store/store.h"

namespace ferry::internal {

// Thread-safe. Owns one thread ("ferry-departures"), started by the first add(); `gone`
// runs on it, never under the watch's lock. The store is shared.
class DepartureWatch {
 public:
  using Gone = std::function<void(int id, absl::Status why)>;
  DepartureWatch(std::shared_ptr<Store> store, std::string self_name, Gone gone);
  ~DepartureWatch();  // stop()
  DepartureWatch(const DepartureWatch&) = delete;
  DepartureWatch& operator=(const DepartureWatch&) = delete;

  // Watches member `id` (`name`, for messages) through its record at `key`. A record
  // already missing is reported at once.
  void add(int id, std::string name, std::string key) ABSL_LOCKS_EXCLUDED(mu_);
  void remove(int id) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the watch within about 100 ms and joins the thread. Idempotent; not from `gone`.
  void stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Watched {
    std::string name;
    std::string key;
  };
  void run();

  const std::shared_ptr<Store> store_;
  const std::string self_name_;
  const Gone gone_;

  absl::Mutex mu_;
  absl::flat_hash_map<int, Watched> watched_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;  // the watched set changed: watch again
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::internal
