#include "agents/core/departures.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/thread_name.h"

namespace ferry::internal {

namespace {
// How long one store watch lasts before it is opened again (it would see nothing new;
// a long one only costs a reconnect now and then).
constexpr std::chrono::seconds kWatchFor{30};
// After a store error (no member of its cluster answers): wait before watching again.
constexpr std::chrono::seconds kRetryAfter{1};
}  // namespace

DepartureWatch::DepartureWatch(std::shared_ptr<Store> store, std::string self_name, Gone gone)
    : store_(std::move(store)), self_name_(std::move(self_name)), gone_(std::move(gone)) {}

DepartureWatch::~DepartureWatch() { stop(); }

void DepartureWatch::add(int id, std::string name, std::string key) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  watched_[id] = Watched{std::move(name), std::move(key)};
  changed_ = true;
  if (!thread_.joinable()) {
    thread_ = std::thread([this] {
      name_this_thread("ferry-departures");
      run();
    });
  }
}

void DepartureWatch::remove(int id) {
  absl::MutexLock lock(&mu_);
  if (watched_.erase(id) > 0) changed_ = true;
}

void DepartureWatch::stop() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void DepartureWatch::run() {
  bool failing = false;
  for (;;) {
    std::vector<std::string> keys;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || changed_; };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      changed_ = false;
      for (const auto& [id, w] : watched_) keys.push_back(w.key);
      // Nothing to watch: wait for the next add().
      if (keys.empty()) continue;
    }
    absl::StatusOr<std::vector<std::string>> vanished = store_->wait_gone(keys, kWatchFor, [this] {
      absl::MutexLock lock(&mu_);
      return stopping_ || changed_;
    });
    if (!vanished.ok()) {
      if (!failing) FERRY_LOG(WARNING) << self_name_ << ": watching the members' records: " << vanished.status();
      failing = true;
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop), absl::FromChrono(kRetryAfter));
      changed_ = true;
      continue;
    }
    failing = false;
    std::vector<std::pair<int, std::string>> lost;
    {
      absl::MutexLock lock(&mu_);
      for (const std::string& key : *vanished) {
        for (auto it = watched_.begin(); it != watched_.end(); ++it) {
          if (it->second.key != key) continue;
          lost.emplace_back(it->first, it->second.name);
          watched_.erase(it);
          break;
        }
      }
      changed_ = true;  // watch what is left (or the same keys again after a timeout)
    }
    for (const auto& [id, name] : lost) {
      gone_(id, absl::UnavailableError(absl::StrCat(
                    "worker \"", name, "\" (id ", id, ") is gone: its record in the store vanished (its store lease ",
                    "expired, ", store_->lease_ttl().count(), " ms after it died or lost the store)")));
    }
  }
}

}  // namespace ferry::internal
