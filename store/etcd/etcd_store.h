// File: store/etcd/etcd_store.h
//
// EtcdStore: a Store kept in an etcd cluster (etcd's v3 API, spoken through its HTTP/JSON
// gateway), so that a job's coordination outlives any one host. Every key lives under a
// job prefix; the client moves to another member when one fails.
//
//   EtcdStoreOptions options;
//   options.endpoints = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379";
//   options.prefix = "job42";
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<EtcdStore> store, EtcdStore::create(options));
//   FERRY_ASSIGN_OR_RETURN(int64_t n, store->add("arrived", 1));   // a transaction
//   FERRY_RETURN_IF_ERROR(store->wait({"go"}));                     // a watch, not polling
//   // Tied to this process's lease: gone within lease_ttl of its death.
//   FERRY_RETURN_IF_ERROR(store->set_owned("workers/3", record));
//
// How each operation maps onto etcd, and why the gateway rather than gRPC: docs/etcd.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "store/store.h"

namespace ferry {

namespace internal {
class EtcdClient;
}

struct EtcdStoreOptions {
  // "host1:2379,host2:2379": the members' client endpoints (an "http://" in front of
  // each is accepted; a missing port is 2379).
  std::string endpoints;
  // Every key of this store lives under "<prefix>/". Not empty.
  std::string prefix = "ferry";
  // The default timeout of blocking operations (Store::timeout()).
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  // How long an operation that does not wait for keys (set, add, check, ...) keeps
  // trying members before it fails with kUnavailable naming the endpoints tried.
  std::chrono::milliseconds request_timeout = std::chrono::seconds(10);
  // How long one member gets to answer before the request moves to the next.
  std::chrono::milliseconds attempt_timeout = std::chrono::seconds(3);
  // etcd's user and password. Unset reads FERRY_ETCD_USER / FERRY_ETCD_PASSWORD; empty
  // means no authentication. Never logged nor put in an error message (the user name
  // may appear in an authentication error; the password never does).
  std::optional<std::string> user;
  std::optional<std::string> password;
  // The TTL of this store's lease (set_owned keys). etcd drops the keys within about
  // this long after the process stops renewing it, e.g. when it was SIGKILLed. The
  // lease is renewed every lease_ttl / 3.
  std::chrono::seconds lease_ttl = std::chrono::seconds(5);
};

// Thread-safe: every method may be called from any thread at once. Blocking operations
// hold one connection each for their watch. Owns a lease-renewing thread once
// set_owned() was first called; the destructor stops it and revokes the lease, so the
// owned keys of a process that ends normally vanish at once.
class EtcdStore : public Store {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdStore>> create(const EtcdStoreOptions& options);
  ~EtcdStore() override;

  absl::Status set(std::string_view key, const Bytes& value) override;
  absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) override;
  using Store::get;
  absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) override;
  absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::Status wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) override;
  using Store::wait;
  absl::StatusOr<bool> delete_key(std::string_view key) override;
  absl::StatusOr<int64_t> num_keys() override;
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                               std::optional<std::chrono::milliseconds> timeout) override;
  using Store::multi_get;
  absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

  // Sets `key` to `value` under this store's lease: the key lives while this process
  // renews the lease and vanishes within lease_ttl once it stops (crash, SIGKILL, lost
  // network) or at once when the store is destroyed.
  absl::Status set_owned(std::string_view key, const Bytes& value) override;
  // compare_set() whose new value is owned as set_owned's is: a lock that frees itself
  // when its holder dies.
  absl::StatusOr<Bytes> compare_set_owned(std::string_view key, const Bytes& expected, const Bytes& desired) override;
  bool has_leases() const override { return true; }
  // One check of every key (a transaction), then a watch for deletions over the range
  // that spans them, read in 100 ms slices so that `stop` is asked; any deletion in the
  // range checks the keys again.
  absl::StatusOr<std::vector<std::string>> wait_gone(const std::vector<std::string>& keys,
                                                     std::chrono::milliseconds timeout,
                                                     const std::function<bool()>& stop) override;

  // Keys (without the prefix) under `key_prefix` and their values, sorted by key.
  absl::StatusOr<std::vector<std::pair<std::string, Bytes>>> list(std::string_view key_prefix);

  // "127.0.0.1:2379, ..." and the prefix, for messages and `ferry store`.
  std::string endpoints_text() const;
  const std::string& prefix() const { return prefix_; }
  std::chrono::milliseconds lease_ttl() const override { return lease_ttl_; }
  // The lease id (granted on first use), for tests.
  absl::StatusOr<int64_t> lease();

 private:
  EtcdStore(std::unique_ptr<internal::EtcdClient> client, const EtcdStoreOptions& options);
  std::string full(std::string_view key) const;
  std::chrono::steady_clock::time_point request_deadline() const;
  absl::StatusOr<Bytes> compare_set_with(std::string_view key, const Bytes& expected, const Bytes& desired,
                                         int64_t lease);
  // wait(), its timeout error naming `op`.
  absl::Status wait_for(const char* op, const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Which of `keys` are missing, and the revision the answer was read at.
  absl::StatusOr<std::vector<std::string>> missing(const std::vector<std::string>& keys, int64_t* revision,
                                                   std::chrono::steady_clock::time_point deadline);
  void renew_loop();

  std::unique_ptr<internal::EtcdClient> client_;
  const std::string prefix_;
  const std::chrono::milliseconds request_timeout_;
  const std::chrono::seconds lease_ttl_;

  absl::Mutex lease_mu_;
  int64_t lease_ ABSL_GUARDED_BY(lease_mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(lease_mu_) = false;
  std::thread renewer_;
};

}  // namespace ferry
