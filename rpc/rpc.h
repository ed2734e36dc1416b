// File: rpc/rpc.h
//
// ferry's public RPC API: start this process's worker, call registered functions on
// other workers, shut down. The free functions act on the process's default agent,
// which init_rpc creates.
//
//   ferry::TensorPipeRpcBackendOptions options;
//   options.init_method = "tcp://127.0.0.1:29500";
//   FERRY_RETURN_IF_ERROR(ferry::init_rpc("worker0", ferry::BackendType::TENSORPIPE, rank, 2, options));
//   int64_t three = ferry::rpc_sync<int64_t>("worker1", "add", int64_t{1}, int64_t{2});
//   ferry::Future<ferry::Tensor> f = ferry::rpc_async<ferry::Tensor>("worker1", "scale", t, 2.0);
//   ferry::Tensor scaled = f.wait();
//   FERRY_RETURN_IF_ERROR(ferry::shutdown());
//
// Errors: init_rpc and shutdown return absl::Status; rpc_sync and Future::wait() throw
// ferry::RpcError carrying the status (the only places ferry throws); rpc_async's
// future and its then() continuations see the status as a value.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/rpc_agent.h"
#include "backends/backend_registry.h"
#include "backends/tensorpipe/tensorpipe_backend.h"
#include "base/future.h"
#include "rpc/call.h"
#include "rpc/function_registry.h"
#include "rpc/remote_function.h"

namespace ferry {

// A per-call timeout for rpc_sync / rpc_async; zero means none.
struct RpcTimeout {
  std::chrono::milliseconds value;
};

namespace internal {
template <typename... T>
inline constexpr bool kFirstIsTimeout = false;
template <typename First, typename... Rest>
inline constexpr bool kFirstIsTimeout<First, Rest...> = std::is_same_v<std::decay_t<First>, RpcTimeout>;
}  // namespace internal

// Starts this process's worker `name` (rank `rank` of `world_size`) with `backend`:
// rendezvous through options.init_method (env://, tcp://HOST:PORT, file://PATH; rank
// and world size are passed to it), then the backend's init handler. Blocks until
// every worker has started. Errors: kFailedPrecondition if this process already has a
// worker; bad arguments (kInvalidArgument); rendezvous and init errors, which every
// worker of the group reports alike.
[[nodiscard]] absl::Status init_rpc(const std::string& name, const BackendType& backend, int rank, int world_size,
                                    const RpcBackendOptions& options);
// The general form: `world_size` nullopt joins a dynamic group, which workers join
// and leave while it runs (one at a time, through a lock in the store). The rank must
// be unique among the members; a duplicate name or rank is refused, naming it; a
// joiner whose device maps do not validate is refused with the validator's message,
// and the group is unchanged. shutdown() then leaves the group: this worker's calls
// finish, every member lets its calls to it finish and forgets it. A worker that hosts
// the store (rank 0 of tcp:// or env://) can leave only last; see shutdown().
[[nodiscard]] absl::Status init_rpc(const std::string& name, const BackendType& backend, int rank,
                                    std::optional<int> world_size, const RpcBackendOptions& options);
// init_rpc with the TENSORPIPE backend.
[[nodiscard]] absl::Status init_rpc(const std::string& name, int rank, int world_size,
                                    const TensorPipeRpcBackendOptions& options = {});

// Stops this process's worker. Graceful (the default): first waits until every worker
// has called shutdown and no worker has calls in flight (at most `timeout`), so
// nothing is lost (in a dynamic group: leaves it); then tears down. Not graceful:
// pending calls fail with kCancelled. The agent is torn down even when waiting fails;
// the error is returned. The one exception is kFailedPrecondition from a dynamic
// member that may not leave yet (it hosts the store and others remain): it keeps
// running, and shutdown can be called again later.
[[nodiscard]] absl::Status shutdown(bool graceful = true,
                                    std::chrono::milliseconds timeout = std::chrono::minutes(5));

// This process's worker, or null before init_rpc / after shutdown.
std::shared_ptr<RpcAgent> current_agent();
// Installs `agent` as the process's default (tests, custom setups); returns the old one.
std::shared_ptr<RpcAgent> set_current_agent(std::shared_ptr<RpcAgent> agent);

// This worker's info; throws RpcError (kFailedPrecondition) before init_rpc.
WorkerInfo get_worker_info();
// A worker's info by name; throws RpcError (kNotFound) for an unknown name.
WorkerInfo get_worker_info(std::string_view name);
std::vector<WorkerInfo> get_worker_infos();

// Tells `listener` of every later change of membership of this worker's group (joins
// and leaves of a dynamic group; lost workers). It runs on the worker's pool, one
// change at a time. Throws RpcError (kFailedPrecondition) before init_rpc.
void add_membership_listener(MembershipListener listener);

namespace internal {
// The default agent, or throws RpcError when there is none. The caller holds it for the
// call's duration, so a concurrent shutdown cannot free it underneath.
std::shared_ptr<RpcAgent> default_agent();
}  // namespace internal

// Calls `fn` on worker `to` and returns a future of its result. The signature sent is
// made from the exact C++ types of R and args (pass int64_t{1}, not 1, to a function
// taking int64_t). See call_async in rpc/call.h for the errors. An error before
// sending (no worker started) is returned in the future.
template <typename R, typename... Args>
Future<internal::WireOf<R>> rpc_async(std::string_view to, std::string_view fn, RpcTimeout timeout,
                                      const Args&... args) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    return make_ready_future<internal::WireOf<R>>(
        absl::FailedPreconditionError("rpc_async: no worker is running in this process; call init_rpc first"));
  }
  return call_async<R>(*agent, to, fn, timeout.value, args...);
}
template <typename R, typename... Args>
Future<internal::WireOf<R>> rpc_async(std::string_view to, std::string_view fn, const Args&... args) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    return make_ready_future<internal::WireOf<R>>(
        absl::FailedPreconditionError("rpc_async: no worker is running in this process; call init_rpc first"));
  }
  return call_async<R>(*agent, to, fn, std::nullopt, args...);
}

// Calls `fn` on worker `to` and waits for its result; throws RpcError on failure.
template <typename R, typename... Args>
R rpc_sync(std::string_view to, std::string_view fn, RpcTimeout timeout, const Args&... args) {
  return call_sync<R>(*internal::default_agent(), to, fn, timeout.value, args...);
}
template <typename R, typename... Args>
R rpc_sync(std::string_view to, std::string_view fn, const Args&... args) {
  return call_sync<R>(*internal::default_agent(), to, fn, std::nullopt, args...);
}

// rpc_async / rpc_sync through a typed handle (rpc/remote_function.h): the arguments
// are converted to the handle's declared types at compile time.
//   ferry::RemoteFunction<int64_t(int64_t, int64_t)> add("add");
//   int64_t three = ferry::rpc_sync("worker1", add, 1, 2);
template <typename R, typename... A, typename... Ts>
  requires(!internal::kFirstIsTimeout<Ts...>)
Future<internal::WireOf<R>> rpc_async(std::string_view to, const RemoteFunction<R(A...)>& fn, Ts&&... args) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    return make_ready_future<internal::WireOf<R>>(
        absl::FailedPreconditionError("rpc_async: no worker is running in this process; call init_rpc first"));
  }
  return call_async(*agent, to, fn, std::nullopt, std::forward<Ts>(args)...);
}
template <typename R, typename... A, typename... Ts>
Future<internal::WireOf<R>> rpc_async(std::string_view to, const RemoteFunction<R(A...)>& fn, RpcTimeout timeout,
                                      Ts&&... args) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    return make_ready_future<internal::WireOf<R>>(
        absl::FailedPreconditionError("rpc_async: no worker is running in this process; call init_rpc first"));
  }
  return call_async(*agent, to, fn, timeout.value, std::forward<Ts>(args)...);
}
template <typename R, typename... A, typename... Ts>
  requires(!internal::kFirstIsTimeout<Ts...>)
R rpc_sync(std::string_view to, const RemoteFunction<R(A...)>& fn, Ts&&... args) {
  return call_sync(*internal::default_agent(), to, fn, std::nullopt, std::forward<Ts>(args)...);
}
template <typename R, typename... A, typename... Ts>
R rpc_sync(std::string_view to, const RemoteFunction<R(A...)>& fn, RpcTimeout timeout, Ts&&... args) {
  return call_sync(*internal::default_agent(), to, fn, timeout.value, std::forward<Ts>(args)...);
}

}  // namespace ferry
