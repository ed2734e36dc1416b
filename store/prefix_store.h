// File: store/prefix_store.h
//
// PrefixStore: a namespace inside another store. Every key is stored as
// "<prefix>/<key>", so several users (sub-groups, retries of a rendezvous) share one
// backing store without colliding.
//
//   auto group = std::make_shared<ferry::PrefixStore>("group1", tcp_store);
//   FERRY_RETURN_IF_ERROR(group->set("ready", ferry::to_bytes("1")));  // sets "group1/ready"
#pragma once

#include <memory>
#include <string>

#include "store/store.h"

namespace ferry {

// Thread-safe as the backing store is. Shares ownership of the backing store. Its
// default timeout starts as the backing store's.
//
// num_keys() counts every key of the backing store, not only those under the prefix:
// a Store cannot list keys, and a count that is sometimes wrong would be worse than one
// documented as the whole store's.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

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
  // The backing store's leases, under the prefix.
  bool has_leases() const override { return base_->has_leases(); }
  std::chrono::milliseconds lease_ttl() const override { return base_->lease_ttl(); }
  absl::Status set_owned(std::string_view key, const Bytes& value) override;
  absl::StatusOr<Bytes> compare_set_owned(std::string_view key, const Bytes& expected, const Bytes& desired) override;
  absl::StatusOr<std::vector<std::string>> wait_gone(const std::vector<std::string>& keys,
                                                     std::chrono::milliseconds timeout,
                                                     const std::function<bool()>& stop) override;

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string full(std::string_view key) const;
  std::vector<std::string> full(const std::vector<std::string>& keys) const;
  // Errors of the backing store name full keys; callers know theirs without the prefix.
  absl::Status strip(absl::Status status) const;

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace ferry
