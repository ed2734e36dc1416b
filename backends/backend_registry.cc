#include "backends/backend_registry.h"

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"

namespace ferry {
namespace {

struct Backend {
  OptionsConstructor constructor;
  InitHandler handler;
};

struct Registry {
  absl::Mutex mu;
  std::map<std::string, Backend> backends ABSL_GUARDED_BY(mu);
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: used until exit
  return *r;
}

absl::StatusOr<Backend> find(const BackendType& backend) {
  Registry& r = registry();
  absl::MutexLock lock(&r.mu);
  auto it = r.backends.find(backend.name);
  if (it == r.backends.end()) {
    return absl::NotFoundError(absl::StrCat("RPC backend ", backend.name, ": not registered"));
  }
  return it->second;
}

}  // namespace

absl::StatusOr<BackendType> register_backend(const std::string& name, OptionsConstructor constructor,
                                             InitHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("register_backend: the backend name is empty");
  if (!constructor || !handler) {
    return absl::InvalidArgumentError(
        absl::StrCat("RPC backend ", name, ": both an options constructor and an init handler are required"));
  }
  Registry& r = registry();
  absl::MutexLock lock(&r.mu);
  auto [it, inserted] = r.backends.try_emplace(name, Backend{std::move(constructor), std::move(handler)});
  if (!inserted) return absl::AlreadyExistsError(absl::StrCat("RPC backend ", name, ": already registered"));
  return BackendType{name};
}

bool backend_registered(const std::string& name) {
  Registry& r = registry();
  absl::MutexLock lock(&r.mu);
  return r.backends.contains(name);
}

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_rpc_backend_options(const BackendType& backend,
                                                                                 std::chrono::milliseconds rpc_timeout,
                                                                                 const std::string& init_method,
                                                                                 const Kwargs& kwargs) {
  FERRY_ASSIGN_OR_RETURN(Backend b, find(backend));
  if (rpc_timeout.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc_timeout must not be negative, got ", rpc_timeout.count(), " ms (zero means no timeout)"));
  }
  return b.constructor(rpc_timeout, init_method, kwargs);
}

absl::StatusOr<std::shared_ptr<RpcAgent>> init_backend(const BackendType& backend, const BackendInitArgs& args) {
  FERRY_ASSIGN_OR_RETURN(Backend b, find(backend));
  if (args.options.backend_name() != backend.name) {
    return absl::InvalidArgumentError(absl::StrCat("RPC backend ", backend.name, ": got options of backend ",
                                                   args.options.backend_name(), "; construct them with ",
                                                   "construct_rpc_backend_options(", backend.name, ", ...)"));
  }
  return b.handler(args);
}

const char* kwarg_type_name(const KwargValue& value) {
  static const char* const kNames[] = {"bool", "int64", "float64", "string", "vector<string>", "device maps",
                                       "vector<Device>"};
  return kNames[value.index()];
}

}  // namespace ferry
