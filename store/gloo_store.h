// File: store/gloo_store.h
//
// GlooStore: lets Gloo rendezvous through any ferry Store. This is the one ferry
// header that includes Gloo; only process_group/ uses it.
//
//   auto gloo_store = std::make_shared<ferry::GlooStore>(store);
//   auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
//   context->connectFullMesh(*gloo_store, device);
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gloo/rendezvous/store.h"
#include "store/store.h"

namespace ferry {

// Thread-safe as the wrapped store is. Shares ownership of it.
//
// Gloo's interface returns nothing and reports errors by exception, so every failed
// operation throws gloo::IoException carrying the ferry status's message (a timeout
// still names the key and the time waited). Callers in process_group/ catch it at the
// Gloo call and turn it back into an absl::Status. get() and the timeout-less wait()
// wait up to the wrapped store's default timeout.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<ferry::Store> store);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  const std::shared_ptr<ferry::Store>& store() const { return store_; }

 private:
  std::shared_ptr<ferry::Store> store_;
};

}  // namespace ferry
