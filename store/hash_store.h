// File: store/hash_store.h
//
// HashStore: a Store held in this process's memory. For tests, for ranks that are
// threads of one process, and as the backing map of other stores.
//
//   auto store = std::make_shared<ferry::HashStore>();
//   FERRY_RETURN_IF_ERROR(store->set("addr/0", ferry::to_bytes("127.0.0.1:5000")));
//   FERRY_ASSIGN_OR_RETURN(ferry::Bytes peer, store->get("addr/0"));
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "store/store.h"

namespace ferry {

// Thread-safe: every method may be called from any thread at once; blocking calls park
// on a condition and wake when a key is set. Owns its keys and values.
class HashStore final : public Store {
 public:
  explicit HashStore(std::chrono::milliseconds timeout = kDefaultTimeout) : Store(timeout) {}

  using Store::get;
  using Store::multi_get;
  using Store::wait;

  absl::Status set(std::string_view key, const Bytes& value) override;
  absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) override;
  absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) override;
  absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::Status wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) override;
  absl::StatusOr<bool> delete_key(std::string_view key) override;
  absl::StatusOr<int64_t> num_keys() override;
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                               std::optional<std::chrono::milliseconds> timeout) override;
  absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

 private:
  // Waits until every key exists; `op` names the caller in the timeout error.
  absl::Status await_keys(std::string_view op, const std::vector<std::string>& keys,
                          std::chrono::milliseconds timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool has_all(const std::vector<std::string>& keys) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Bytes> map_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry
