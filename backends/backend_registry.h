// File: backends/backend_registry.h
//
// The registry of RPC backends (seeds 003/002): each backend is a name, a constructor
// of its options from typed keyword arguments, and an init handler that builds its
// agent. TENSORPIPE and PROCESS_GROUP are built in; users register their own the same way.
//
//   absl::StatusOr<BackendType> mine = register_backend("MINE", make_my_options, init_my_agent);
//   auto options = construct_rpc_backend_options(*mine, std::chrono::seconds(30), "env://",
//                                                {{"num_worker_threads", int64_t{4}}});
//   auto agent = init_backend(*mine, {store, "worker0", 0, 2, **options, handler});
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "agents/rpc_agent.h"
#include "device_maps/device_map.h"
#include "device_maps/options.h"
#include "store/store.h"
#include "tensor/device.h"

namespace ferry {

inline constexpr std::chrono::milliseconds kDefaultRpcTimeout{std::chrono::seconds(60)};
inline constexpr char kDefaultInitMethod[] = "env://";

// A backend, by name. Cheap to copy.
struct BackendType {
  std::string name;

  // The built-in TensorPipe backend.
  static const BackendType TENSORPIPE;
  // The built-in process-group backend (Gloo send/recv; backends/process_group/).
  static const BackendType PROCESS_GROUP;

  friend bool operator==(const BackendType&, const BackendType&) = default;
};
inline const BackendType BackendType::TENSORPIPE{"TENSORPIPE"};
inline const BackendType BackendType::PROCESS_GROUP{"PROCESS_GROUP"};

// The options every backend has. A backend derives its own options type from it.
class RpcBackendOptions {
 public:
  virtual ~RpcBackendOptions() = default;
  // The name of the backend these options belong to ("TENSORPIPE", ...).
  virtual std::string backend_name() const = 0;

  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout = kDefaultRpcTimeout;
  // Where the workers rendezvous: env://, tcp://HOST:PORT or file://PATH.
  std::string init_method = kDefaultInitMethod;
};

// A keyword argument's value: the types backends' options are made of.
using KwargValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>, DeviceMaps,
                                std::vector<Device>>;
using Kwargs = std::map<std::string, KwargValue>;

// What an init handler gets. The references live until the handler returns.
struct BackendInitArgs {
  std::shared_ptr<Store> store;
  std::string name;
  int rank = 0;
  int world_size = 0;  // 0: a dynamic group (workers join and leave)
  const RpcBackendOptions& options;
  RequestHandler handler;  // how the agent runs incoming requests
  InlineFilter serves_inline;  // which of them it may run on the transport thread
};

using OptionsConstructor = std::function<absl::StatusOr<std::unique_ptr<RpcBackendOptions>>(
    std::chrono::milliseconds rpc_timeout, const std::string& init_method, const Kwargs& kwargs)>;
using InitHandler = std::function<absl::StatusOr<std::shared_ptr<RpcAgent>>(const BackendInitArgs& args)>;

// Registers a backend. Errors: kAlreadyExists "RPC backend NAME: already registered";
// kInvalidArgument for an empty name or a missing constructor or handler. Thread-safe.
[[nodiscard]] absl::StatusOr<BackendType> register_backend(const std::string& name, OptionsConstructor constructor,
                                                           InitHandler handler);
// Whether `name` is registered (built-in backends count once registered, see below).
bool backend_registered(const std::string& name);
// Calls `backend`'s options constructor. Errors: kNotFound for an unregistered
// backend; the constructor's own (an unknown keyword argument is kInvalidArgument
// naming it; a value of the wrong type names the key and both types).
[[nodiscard]] absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_rpc_backend_options(
    const BackendType& backend, std::chrono::milliseconds rpc_timeout = kDefaultRpcTimeout,
    const std::string& init_method = kDefaultInitMethod, const Kwargs& kwargs = {});
// Calls `backend`'s init handler. Errors: kNotFound for an unregistered backend,
// kInvalidArgument when args.options belong to another backend, and the handler's.
[[nodiscard]] absl::StatusOr<std::shared_ptr<RpcAgent>> init_backend(const BackendType& backend,
                                                                     const BackendInitArgs& args);

// Registers the built-in backends, TENSORPIPE and PROCESS_GROUP, and the built-in
// transports (once; later calls do nothing; backends/builtin.cc lists them). init_rpc
// calls it; call it yourself before using the registries directly. Explicit, because a static library's self-registering
// initializers are dropped by the linker.
void register_builtin_backends();
// Registers the built-in transports in the transport registry (agents/core/registry.h):
// "ring", and TensorPipe's "shm", "ibv", "uv" (once; backends/builtin.cc lists them).
// register_builtin_backends() and the TENSORPIPE backend call it.
void register_builtin_transports();

// The name of a KwargValue's type ("int64", "string", ...), for error messages.
const char* kwarg_type_name(const KwargValue& value);

// Keyword argument `key` of backend `backend` ("TENSORPIPE") as a T; kInvalidArgument
// saying it must be `expected` otherwise. (backends/kwargs.h does this for a whole table.)
template <typename T>
absl::StatusOr<T> kwarg_as(const char* backend, const std::string& key, const KwargValue& value,
                           const char* expected) {
  if (const T* v = std::get_if<T>(&value)) return *v;
  return absl::InvalidArgumentError(absl::StrCat(backend, " option \"", key, "\" must be ", expected, ", got ",
                                                 kwarg_type_name(value)));
}

}  // namespace ferry
