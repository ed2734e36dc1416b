#include "process_group/internal/gloo_store.h"

#include "base/logging.h"
#include "gloo/common/error.h"

namespace ferry::internal {

GlooStore::GlooStore(std::shared_ptr<ferry::Store> store) : store_(std::move(store)) {
  FERRY_CHECK(store_ != nullptr) << "GlooStore needs a store";
}

void GlooStore::fail(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = status;
  }
  throw gloo::IoException(std::string(status.message()));
}

absl::Status GlooStore::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status s = store_->set(key, Bytes(data.begin(), data.end()));
  if (!s.ok()) fail(s);
}

std::vector<char> GlooStore::get(const std::string& key) {
  absl::StatusOr<Bytes> value = store_->get(key);
  if (!value.ok()) fail(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  absl::Status s = store_->wait(keys);
  if (!s.ok()) fail(s);
}

void GlooStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  absl::Status s = store_->wait(keys, timeout);
  if (!s.ok()) fail(s);
}

}  // namespace ferry::internal
