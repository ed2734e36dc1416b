#include "process_group/work.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "process_group/internal/work_state.h"

namespace ferry {
namespace internal {

bool WorkState::complete(absl::Status status, std::optional<int> source_rank) {
  absl::StatusOr<int> result;
  {
    absl::MutexLock lock(&mu_);
    if (done_) return false;
    done_ = true;
    status_ = std::move(status);
    source_rank_ = status_.ok() ? source_rank : std::nullopt;
    result = status_.ok() ? absl::StatusOr<int>(source_rank_.value_or(-1)) : absl::StatusOr<int>(status_);
  }
  // Outside the lock: callbacks may poll this Work.
  promise_.set_result(std::move(result));
  return true;
}

absl::Status WorkState::wait(std::optional<std::chrono::milliseconds> timeout) const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
  if (!timeout.has_value()) {
    mu_.Await(absl::Condition(&done));
  } else if (!mu_.AwaitWithTimeout(absl::Condition(&done), absl::FromChrono(*timeout))) {
    return absl::DeadlineExceededError(
        absl::StrCat(name_, ": not completed within the ", timeout->count(), " ms wait (it is still pending)"));
  }
  return status_;
}

bool WorkState::is_completed() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

std::optional<int> WorkState::source_rank() const {
  absl::MutexLock lock(&mu_);
  return source_rank_;
}

}  // namespace internal

absl::Status Work::wait(std::optional<std::chrono::milliseconds> timeout) const { return state_->wait(timeout); }

bool Work::is_completed() const { return state_->is_completed(); }

std::optional<int> Work::source_rank() const { return state_->source_rank(); }

const std::string& Work::name() const { return state_->name(); }

Future<int> Work::future() const { return state_->future(); }

void Work::add_callback(std::function<void(const absl::Status&)> callback) const {
  state_->future().add_callback([callback = std::move(callback)](const absl::StatusOr<int>& r) { callback(r.status()); });
}

Work Work::completed(std::string name, absl::Status status) {
  auto state = std::make_shared<internal::WorkState>(std::move(name));
  state->complete(std::move(status));
  return Work(std::move(state));
}

}  // namespace ferry
