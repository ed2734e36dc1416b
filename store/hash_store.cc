#include "store/hash_store.h"

#include "absl/time/time.h"
#include "base/status.h"
#include "store/internal/store_util.h"

namespace ferry {

using internal::av;

bool HashStore::has_all(const std::vector<std::string>& keys) const {
  for (const std::string& k : keys) {
    if (!map_.contains(k)) return false;
  }
  return true;
}

absl::Status HashStore::await_keys(std::string_view op, const std::vector<std::string>& keys,
                                   std::chrono::milliseconds timeout) {
  auto start = std::chrono::steady_clock::now();
  auto ready = [this, &keys]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return has_all(keys); };
  if (mu_.AwaitWithTimeout(absl::Condition(&ready), absl::FromChrono(timeout))) return absl::OkStatus();
  std::vector<std::string> missing;
  for (const std::string& k : keys) {
    if (!map_.contains(k)) missing.push_back(k);
  }
  return internal::wait_timeout_error(op, missing, internal::elapsed_since(start));
}

absl::Status HashStore::set(std::string_view key, const Bytes& value) {
  absl::MutexLock lock(&mu_);
  map_.insert_or_assign(std::string(key), value);
  return absl::OkStatus();
}

absl::StatusOr<Bytes> HashStore::get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> keys{std::string(key)};
  FERRY_RETURN_IF_ERROR(await_keys("get", keys, effective(timeout)));
  return map_.at(keys[0]);
}

absl::StatusOr<int64_t> HashStore::add(std::string_view key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  auto it = map_.find(av(key));
  int64_t value = 0;
  if (it != map_.end()) {
    FERRY_ASSIGN_OR_RETURN(value, internal::parse_counter(key, it->second));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t sum, internal::add_counter(key, value, delta));
  map_.insert_or_assign(std::string(key), internal::format_counter(sum));
  return sum;
}

absl::StatusOr<Bytes> HashStore::compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) {
  absl::MutexLock lock(&mu_);
  auto it = map_.find(av(key));
  if (it == map_.end()) {
    if (!expected.empty()) return Bytes();
    map_.emplace(std::string(key), desired);
    return desired;
  }
  if (it->second == expected) it->second = desired;
  return it->second;
}

absl::StatusOr<bool> HashStore::check(const std::vector<std::string>& keys) {
  absl::ReaderMutexLock lock(&mu_);
  return has_all(keys);
}

absl::Status HashStore::wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) {
  absl::MutexLock lock(&mu_);
  return await_keys("wait", keys, effective(timeout));
}

absl::StatusOr<bool> HashStore::delete_key(std::string_view key) {
  absl::MutexLock lock(&mu_);
  return map_.erase(av(key)) > 0;
}

absl::StatusOr<int64_t> HashStore::num_keys() {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int64_t>(map_.size());
}

absl::StatusOr<std::vector<Bytes>> HashStore::multi_get(const std::vector<std::string>& keys,
                                                        std::optional<std::chrono::milliseconds> timeout) {
  absl::MutexLock lock(&mu_);
  FERRY_RETURN_IF_ERROR(await_keys("multi_get", keys, effective(timeout)));
  std::vector<Bytes> values;
  values.reserve(keys.size());
  for (const std::string& k : keys) values.push_back(map_.at(k));
  return values;
}

absl::Status HashStore::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) return internal::multi_set_size_error(keys.size(), values.size());
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < keys.size(); ++i) map_.insert_or_assign(keys[i], values[i]);
  return absl::OkStatus();
}

}  // namespace ferry
