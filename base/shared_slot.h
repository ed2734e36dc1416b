// File: base/shared_slot.h
//
// SharedSlot<T>: a std::shared_ptr<T> that threads read and replace concurrently
// (a process-wide default, a membership table swapped copy-on-write).
//
//   SharedSlot<const Table> table(std::make_shared<const Table>());
//   std::shared_ptr<const Table> now = table.load();     // any thread
//   table.store(std::make_shared<const Table>(next));    // readers see old or new
//
// Why not std::atomic<std::shared_ptr<T>>: libstdc++ 12's load() releases its internal
// spin bit with a relaxed store, so its read of the pointer does not happen-before the
// next store()'s write. That is a data race in the C++ memory model (harmless on x86,
// and reported by ThreadSanitizer; docs/checks.md). A reader lock costs the same two
// atomic read-modify-writes per load and is race-free.
//
// Thread-safe. A replaced value is released after the lock is dropped, so its
// destructor may take other locks (or read this slot).
#pragma once

#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ferry {

template <typename T>
class SharedSlot {
 public:
  SharedSlot() = default;
  explicit SharedSlot(std::shared_ptr<T> value) : value_(std::move(value)) {}
  SharedSlot(const SharedSlot&) = delete;
  SharedSlot& operator=(const SharedSlot&) = delete;

  std::shared_ptr<T> load() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::ReaderMutexLock lock(&mu_);
    return value_;
  }

  // Replaces the value; returns the one it held.
  std::shared_ptr<T> exchange(std::shared_ptr<T> value) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    value_.swap(value);
    return value;
  }

  void store(std::shared_ptr<T> value) ABSL_LOCKS_EXCLUDED(mu_) { exchange(std::move(value)); }

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<T> value_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry
