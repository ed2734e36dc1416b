// File: store/store.h
//
// Store: the key-value store every worker of a job reaches, used to rendezvous
// (exchange addresses, count arrivals, hand out ranks). Keys are strings, values are
// bytes. Every store implements every operation; one parameterized test suite runs
// over all of them (tests/store/store_test.cc).
//
//   std::shared_ptr<Store> store = ...;           // TCPStore, FileStore, HashStore, ...
//   FERRY_RETURN_IF_ERROR(store->set("addr/0", to_bytes("127.0.0.1:5000")));
//   FERRY_ASSIGN_OR_RETURN(Bytes peer, store->get("addr/1"));   // waits for the key
//   FERRY_ASSIGN_OR_RETURN(int64_t arrived, store->add("arrived", 1));
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry {

using Bytes = std::vector<uint8_t>;

inline Bytes to_bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

// Thread-safe: every method may be called from any thread at once. Blocking methods
// (get, wait, multi_get) wait at most the timeout given, or the store's default
// timeout(), and then fail with kDeadlineExceeded naming the key(s) and the time waited.
// A store that lost its backing service fails with kUnavailable.
class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

  explicit Store(std::chrono::milliseconds timeout = kDefaultTimeout) : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Sets `key` to `value`, replacing any value, and wakes its waiters.
  virtual absl::Status set(std::string_view key, const Bytes& value) = 0;
  // The value of `key`, waiting until it exists or the timeout passes.
  virtual absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) = 0;
  absl::StatusOr<Bytes> get(std::string_view key) { return get(key, std::nullopt); }
  // Atomically adds `delta` to the counter at `key` (a missing key counts as 0) and
  // returns the new value. A key holding a non-counter value is kInvalidArgument.
  virtual absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) = 0;
  // Atomically: if `key` holds `expected` (or is missing and `expected` is empty), sets
  // it to `desired`. Returns the value the key holds afterwards (desired on success;
  // empty when the key is missing and `expected` was not empty, which sets nothing).
  virtual absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) = 0;
  // Whether every key exists, without waiting.
  virtual absl::StatusOr<bool> check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists.
  virtual absl::Status wait(const std::vector<std::string>& keys,
                            std::optional<std::chrono::milliseconds> timeout) = 0;
  absl::Status wait(const std::vector<std::string>& keys) { return wait(keys, std::nullopt); }
  // Removes `key`; returns whether it existed.
  virtual absl::StatusOr<bool> delete_key(std::string_view key) = 0;
  // How many keys the store holds.
  virtual absl::StatusOr<int64_t> num_keys() = 0;
  // The values of all keys, in order, waiting for each as get() does.
  virtual absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                                       std::optional<std::chrono::milliseconds> timeout) = 0;
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys) {
    return multi_get(keys, std::nullopt);
  }
  // Sets every key to its value (keys.size() must equal values.size()).
  virtual absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) = 0;

  // ---- What belongs to a living process: keys under this process's lease.
  // Whether set_owned() ties a key to this process's life: the key then vanishes within
  // lease_ttl() of the process's death (SIGKILL, a crash, a lost network) without anyone
  // probing, and wait_gone() reports it (EtcdStore). A store without leases (TCPStore,
  // FileStore, HashStore) keeps an owned key as set() does, until someone deletes it;
  // its users find a dead process as before, by probing it.
  virtual bool has_leases() const { return false; }
  // The most an owned key outlives its owner's death; zero without leases.
  virtual std::chrono::milliseconds lease_ttl() const { return std::chrono::milliseconds(0); }
  // set() and compare_set() whose written value is owned as above.
  virtual absl::Status set_owned(std::string_view key, const Bytes& value) { return set(key, value); }
  virtual absl::StatusOr<Bytes> compare_set_owned(std::string_view key, const Bytes& expected, const Bytes& desired) {
    return compare_set(key, expected, desired);
  }
  // Waits until one of `keys` is missing (deleted, its owner's lease expired, or never
  // set), at most `timeout`, or until `stop` returns true (asked on this thread about
  // every 100 ms; it must not block). Returns the missing keys: empty when the timeout
  // passed or `stop` ended the wait. With leases, a watch, not polling. Errors: the
  // store's; kUnimplemented for a store without leases.
  virtual absl::StatusOr<std::vector<std::string>> wait_gone(const std::vector<std::string>& keys,
                                                             std::chrono::milliseconds timeout,
                                                             const std::function<bool()>& stop) {
    (void)keys, (void)timeout, (void)stop;
    return absl::UnimplementedError("this store has no leases, so it cannot report a departed owner's keys");
  }

  // The default timeout of blocking operations.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 protected:
  std::chrono::milliseconds effective(std::optional<std::chrono::milliseconds> timeout) const {
    return timeout.value_or(timeout_);
  }

 private:
  std::chrono::milliseconds timeout_;
};

}  // namespace ferry
