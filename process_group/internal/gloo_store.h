// File: process_group/internal/gloo_store.h
//
// GlooStore: lets Gloo rendezvous through any ferry Store. Internal to process_group/
// (never installed), so no public ferry header includes Gloo.
//
//   ferry::internal::GlooStore gloo_store(store);
//   try {
//     context->connectFullMesh(gloo_store, device);
//   } catch (const gloo::IoException&) {
//     absl::Status why = gloo_store.last_error();   // the store's own status, code and all
//   }
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gloo/rendezvous/store.h"
#include "store/store.h"

namespace ferry::internal {

// Thread-safe as the wrapped store is. Shares ownership of it.
//
// Gloo's interface returns nothing and reports errors by exception, so a failed
// operation throws gloo::IoException (carrying the status's message, for Gloo's own
// logs) — and keeps the ferry status itself: last_error() hands it back as a value,
// so callers never parse a message to recover a code. get() and the timeout-less
// wait() wait up to the wrapped store's default timeout.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<ferry::Store> store);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // The first error an operation hit (OK when none has).
  absl::Status last_error() const;
  const std::shared_ptr<ferry::Store>& store() const { return store_; }

 private:
  // Records `status` (the first error wins) and throws.
  [[noreturn]] void fail(const absl::Status& status);

  std::shared_ptr<ferry::Store> store_;
  mutable std::mutex mu_;
  absl::Status error_;  // guarded by mu_
};

}  // namespace ferry::internal
