#include "store/prefix_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry {

using internal::av;

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : Store(base ? base->timeout() : kDefaultTimeout), prefix_(std::move(prefix)), base_(std::move(base)) {
  FERRY_CHECK(base_ != nullptr) << "PrefixStore needs a backing store";
}

std::string PrefixStore::full(std::string_view key) const { return absl::StrCat(prefix_, "/", av(key)); }

std::vector<std::string> PrefixStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(full(k));
  return out;
}

absl::Status PrefixStore::strip(absl::Status status) const {
  if (status.ok()) return status;
  // Keys are quoted in store errors, so "'<prefix>/" only matches the start of a key.
  std::string text = absl::StrReplaceAll(status.message(), {{absl::StrCat("'", prefix_, "/"), "'"}});
  return absl::Status(status.code(), text);
}

absl::Status PrefixStore::set(std::string_view key, const Bytes& value) { return strip(base_->set(full(key), value)); }

absl::StatusOr<Bytes> PrefixStore::get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) {
  auto r = base_->get(full(key), effective(timeout));
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::StatusOr<int64_t> PrefixStore::add(std::string_view key, int64_t delta) {
  auto r = base_->add(full(key), delta);
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::StatusOr<Bytes> PrefixStore::compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) {
  auto r = base_->compare_set(full(key), expected, desired);
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::StatusOr<bool> PrefixStore::check(const std::vector<std::string>& keys) {
  auto r = base_->check(full(keys));
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::Status PrefixStore::wait(const std::vector<std::string>& keys,
                               std::optional<std::chrono::milliseconds> timeout) {
  return strip(base_->wait(full(keys), effective(timeout)));
}

absl::StatusOr<bool> PrefixStore::delete_key(std::string_view key) {
  auto r = base_->delete_key(full(key));
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::StatusOr<int64_t> PrefixStore::num_keys() { return base_->num_keys(); }

absl::StatusOr<std::vector<Bytes>> PrefixStore::multi_get(const std::vector<std::string>& keys,
                                                          std::optional<std::chrono::milliseconds> timeout) {
  auto r = base_->multi_get(full(keys), effective(timeout));
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::Status PrefixStore::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  return strip(base_->multi_set(full(keys), values));
}

absl::Status PrefixStore::set_owned(std::string_view key, const Bytes& value) {
  return strip(base_->set_owned(full(key), value));
}

absl::StatusOr<Bytes> PrefixStore::compare_set_owned(std::string_view key, const Bytes& expected,
                                                     const Bytes& desired) {
  auto r = base_->compare_set_owned(full(key), expected, desired);
  if (!r.ok()) return strip(r.status());
  return r;
}

absl::StatusOr<std::vector<std::string>> PrefixStore::wait_gone(const std::vector<std::string>& keys,
                                                                std::chrono::milliseconds timeout,
                                                                const std::function<bool()>& stop) {
  auto r = base_->wait_gone(full(keys), timeout, stop);
  if (!r.ok()) return strip(r.status());
  const size_t strip_size = prefix_.size() + 1;
  for (std::string& k : *r) k.erase(0, std::min(strip_size, k.size()));
  return r;
}

}  // namespace ferry
