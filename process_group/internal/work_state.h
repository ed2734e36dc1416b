// File: process_group/internal/work_state.h
//
// WorkState: the shared completion state behind ferry::Work. The process group
// completes it once from whichever thread ran the operation; Work handles wait on it.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "base/future.h"

namespace ferry::internal {

// Thread-safe.
class WorkState {
 public:
  explicit WorkState(std::string name) : name_(std::move(name)) {}

  // Completes the operation; only the first call counts. Returns whether it was it.
  bool complete(absl::Status status, std::optional<int> source_rank = std::nullopt);

  absl::Status wait(std::optional<std::chrono::milliseconds> timeout) const;
  bool is_completed() const;
  std::optional<int> source_rank() const;
  const std::string& name() const { return name_; }
  // Completes with the source rank (-1 when there is none) or the error, after the
  // state above; its callbacks run on the completing thread.
  Future<int> future() const { return promise_.get_future(); }

 private:
  const std::string name_;
  const Promise<int> promise_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::optional<int> source_rank_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::internal
