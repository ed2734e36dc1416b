#include "store/gloo_store.h"

#include "absl/status/status.h"
#include "base/logging.h"
#include "gloo/common/error.h"

namespace ferry {

namespace {
[[noreturn]] void throw_status(const absl::Status& status) {
  throw gloo::IoException(status.ToString());
}
}  // namespace

GlooStore::GlooStore(std::shared_ptr<ferry::Store> store) : store_(std::move(store)) {
  FERRY_CHECK(store_ != nullptr) << "GlooStore needs a store";
}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status s = store_->set(key, Bytes(data.begin(), data.end()));
  if (!s.ok()) throw_status(s);
}

std::vector<char> GlooStore::get(const std::string& key) {
  absl::StatusOr<Bytes> value = store_->get(key);
  if (!value.ok()) throw_status(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  absl::Status s = store_->wait(keys);
  if (!s.ok()) throw_status(s);
}

void GlooStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  absl::Status s = store_->wait(keys, timeout);
  if (!s.ok()) throw_status(s);
}

}  // namespace ferry
