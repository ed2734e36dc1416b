#include "base/progress.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

namespace ferry::internal {
namespace {

// Registrations are rare (one per transport that lives a whole job) and polls are
// frequent, so a poll reads one version number and copies the list only when it moved.
struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<Progress>> list;  // guarded by mu
  std::atomic<uint64_t> version{0};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: threads may poll at exit
  return *r;
}

struct Snapshot {
  uint64_t version = 0;
  std::vector<std::shared_ptr<Progress>> list;
};

thread_local bool t_driving = false;

}  // namespace

ProgressRegistration::ProgressRegistration(std::shared_ptr<Progress> progress) : progress_(std::move(progress)) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.list.push_back(progress_);
  r.version.fetch_add(1, std::memory_order_release);
}

ProgressRegistration::~ProgressRegistration() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::erase(r.list, progress_);
  r.version.fetch_add(1, std::memory_order_release);
}

const std::vector<std::shared_ptr<Progress>>& registered_progress() {
  thread_local Snapshot snapshot;
  Registry& r = registry();
  const uint64_t version = r.version.load(std::memory_order_acquire);
  if (version != snapshot.version) {
    std::lock_guard<std::mutex> lock(r.mu);
    snapshot.list = r.list;
    snapshot.version = r.version.load(std::memory_order_relaxed);
  }
  return snapshot.list;
}

bool driving_progress() { return t_driving; }
void set_driving_progress(bool on) { t_driving = on; }

}  // namespace ferry::internal
