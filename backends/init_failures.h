// File: backends/init_failures.h
//
// Init fails fast everywhere: the built-in backends' init handlers publish the first
// failure of an init in the store, and every other rank's init ends with that same
// error within a poll interval instead of waiting out its timeout.
//
//   InitFailures failures(args.store, "ferry/rpc/init/7/");
//   std::shared_ptr<Store> watched = failures.watching_store();   // waits end on a failure
//   ... do the init's store waits (or ProcessGroup::create) through `watched` ...
//   if (!status.ok()) {
//     status = failures.conclude(args.rank, args.name, status);
//     failures.linger(args.world_size);   // the store's host stays until all read it
//     return status;
//   }
//   failures.disarm();   // init done: the watched store is a plain pass-through again
//
// The error every rank returns reads "init_rpc failed on rank 2 (worker \"w2\"): <why>",
// with rank 2's status code.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "store/store.h"
#include "store/store_host.h"  // store_host_of, which the backends use with this

namespace ferry::internal {

// The message every rank's init ends with when rank `rank` (worker `name`) failed
// (conclude() publishes it as is).
absl::Status init_failure(int rank, std::string_view name, absl::StatusCode code, std::string_view why);
// Marks `status` as a verdict every rank reaches by itself from the same records
// (duplicate worker names, inconsistent device maps): conclude() returns it unchanged.
absl::Status group_verdict(absl::Status status);

// One init generation's failure record. Thread-safe.
class InitFailures {
 public:
  // How often a watched wait looks for a published failure.
  static constexpr std::chrono::milliseconds kPollInterval{200};

  // `prefix` scopes the init ("ferry/rpc/init/<generation>/"); the record is
  // "<prefix>failed".
  InitFailures(std::shared_ptr<Store> store, std::string prefix);

  // A store over this init's store whose blocking calls (get, wait, multi_get) end with
  // the published failure soon after one is published; pass-through once disarmed.
  // Shares ownership of the backing store.
  std::shared_ptr<Store> watching_store() const { return watched_; }

  // The init's outcome from this rank's view: ok stays ok. Otherwise the failure already
  // published (so every rank ends with the same one); else a timeout (kDeadlineExceeded,
  // which names the ranks that never arrived) or a group_verdict() as is, unpublished;
  // else `status` published and returned: as is when made by init_failure(), else as
  // init_failure() of this rank.
  absl::Status conclude(int rank, std::string_view name, const absl::Status& status);

  // After a failed init: counts this rank out, and on the rank whose process serves
  // the store, waits until all `world_size` ranks have counted out (at most `grace`),
  // so that no rank loses the store, when that process exits, before it read the
  // published failure.
  static constexpr std::chrono::milliseconds kLingerGrace{3000};
  void linger(int world_size, std::chrono::milliseconds grace = kLingerGrace);

  // The published failure, if there is one; nullopt when none (or the store failed).
  std::optional<absl::Status> published() const;

  // Init succeeded: stop looking for failures.
  void disarm();

  const std::string& key() const { return key_; }

 private:
  std::shared_ptr<Store> store_;
  std::string prefix_;
  std::string key_;
  std::shared_ptr<std::atomic<bool>> armed_;
  std::shared_ptr<Store> watched_;
};

}  // namespace ferry::internal
