// File: rpc/rref.h
//
// Remote references. remote<T>(to, fn, args...) runs `fn` on worker `to` and returns
// at once an RRef<T>: a reference to the result, which stays on `to` (its owner).
// Fetch a copy with to_here(), run functions on the owner with the value through the
// RRef, and pass the RRef in the arguments of any call to share it with another
// worker. The owner frees the value once no worker holds a reference to it any more.
//
//   // registered on every worker: a factory, and a function that takes the RRef first
//   auto make = *ferry::register_remote_function("make_counter", [](int64_t start) { return Counter{start}; });
//   auto bump = *ferry::register_remote_function("bump", [](ferry::RRef<Counter> c, int64_t by) {
//     return c.local_value().n += by;          // runs on the owner, on the live value
//   });
//   ferry::RRef<Counter> c = ferry::remote("worker1", make, 10);   // the Counter lives on worker1
//   int64_t n = c.rpc_sync(bump, 5);                               // 15, computed on worker1
//   Counter copy = c.to_here();                                    // a copy, fetched
//   ferry::rpc_sync("worker2", use_counter, c);                    // worker2 now holds it too
//
// How references are counted (docs/rref.md has the whole protocol): every worker that
// holds an RRef it does not own has its own fork of it, which the owner records, with
// the worker holding it. remote() records the creator's fork with the creation; an
// RRef received in a call's arguments registers the receiver's fork with the owner
// (one round trip) before the function runs, while the sender keeps its own reference
// until the call's reply arrives. When the last copy of a worker's RRef is destroyed,
// it tells the owner, which drops that fork; the value is freed when no fork and no
// RRef on the owner itself remain. When a worker holding forks is lost or leaves (the
// agent's membership listener), the owner drops its forks. When the owner is lost,
// to_here() and calls through the RRef fail with kUnavailable naming it.
//
// RRefs travel in the arguments of calls (rpc_sync, rpc_async, remote, and calls
// through an RRef), also nested in vectors, maps and structs; not in results. Drop
// your RRefs before shutdown(): references still alive at shutdown are not counted
// out (every worker frees what it owns when it shuts down).
//
// Thread safety: an RRef is a value type; copies share the reference, and every method
// may be called from any thread. to_here() and rpc_sync() block; to_here_async() and
// rpc_async() complete their futures as rpc_async does (base/future.h).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/rpc_agent.h"
#include "base/future.h"
#include "rpc/function_registry.h"
#include "rpc/remote_function.h"
#include "rpc/rpc.h"
#include "serialization/types.h"

namespace ferry {

template <typename T>
class RRef;

namespace internal {

// One worker's reference to a value (owned here or elsewhere); shared by the copies of
// an RRef. Defined in rpc/internal/rref_context.h.
class RRefState;
template <typename T>
struct RRefAccess;

WorkerInfo rref_owner(const RRefState& state);
bool rref_is_owner(const RRefState& state);
std::string rref_describe(const RRefState& state);
// The agent of the RRef's worker, or an error naming the RRef once it has shut down.
[[nodiscard]] absl::StatusOr<std::shared_ptr<RpcAgent>> rref_agent(const RRefState& state);
// Fetches the value from the owner: the reply holds one `type`. Errors name the RRef
// and its owner.
Future<Message> rref_fetch(const std::shared_ptr<RRefState>& state, const std::string& type,
                           std::optional<std::chrono::milliseconds> timeout);
// On the owner: the live value, once created (waits at most `timeout`). Errors: not
// the owner (kFailedPrecondition), the creation's own error, a type other than `type`.
[[nodiscard]] absl::StatusOr<std::shared_ptr<void>> rref_local_value(const RRefState& state, const std::string& type,
                                                                     std::optional<std::chrono::milliseconds> timeout);
// Starts remote(): creates the reference and sends the creation of a `type` by `fn`
// (whose call signature is `signature`) to worker `to`; `write_args` writes the
// arguments. Never throws: an error before sending is kept in the RRef.
std::shared_ptr<RRefState> rref_remote(std::string_view to, const std::string& type, std::string_view fn,
                                       const std::string& signature,
                                       const std::function<void(PayloadWriter&)>& write_args);
// A reference to `value`, owned by this worker.
std::shared_ptr<RRefState> rref_make_local(OwnedValue value);
// An RRef's wire form inside a call's arguments (see the file comment). Throw
// cereal::Exception on misuse, which the call reports.
void rref_save(PayloadWriter& writer, const std::shared_ptr<RRefState>& state, const std::string& type);
std::shared_ptr<RRefState> rref_load(PayloadReader& reader, const std::string& type);

template <typename T>
absl::StatusOr<T> copy_value(const T& value) {
  if constexpr (std::is_copy_constructible_v<T>) {
    return T(value);
  } else {
    Message m(MessageType::kResponse, 0);
    {
      PayloadWriter w(m);
      w(value);
    }
    absl::StatusOr<std::tuple<T>> back = read_payload<T>(m, "value");
    if (!back.ok()) return back.status();
    return std::get<0>(*std::move(back));
  }
}

template <typename T>
void save_owned(PayloadWriter& writer, const void* object) {
  writer(*static_cast<const T*>(object));
}

}  // namespace internal

// A reference to a T that lives on its owner worker. See the file comment.
template <typename T>
class RRef {
  static_assert(std::is_same_v<T, std::decay_t<T>> && !std::is_void_v<T>,
                "ferry::RRef<T>: T is a value type (no void, const or references)");

 public:
  using value_type = T;

  // An empty RRef (valid() is false); only assignment, valid() and serialization of
  // a non-empty one may be used.
  RRef() = default;

  bool valid() const { return state_ != nullptr; }
  // The worker the value lives on.
  WorkerInfo owner() const { return internal::rref_owner(*state_); }
  // Whether this worker owns the value.
  bool is_owner() const { return internal::rref_is_owner(*state_); }
  // E.g. "RRef 1:7 owned by \"worker0\"".
  std::string to_string() const { return internal::rref_describe(*state_); }

  // A copy of the value, fetched from the owner (or copied, on the owner). Completes
  // with the creation's error if creating the value failed, with kUnavailable naming
  // the owner if it was lost, kDeadlineExceeded after `timeout` (none: the agent's
  // default). The future completes as rpc_async's do.
  Future<T> to_here_async(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const {
    if (is_owner()) return make_ready_future<T>(local_copy(timeout));
    return internal::rref_fetch(state_, TypeName<T>::get(), timeout).then([](const absl::StatusOr<Message>& reply) {
      return internal::decode_reply<T>(reply);
    });
  }
  // to_here_async(), waited for; throws RpcError on failure.
  T to_here(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const {
    if (is_owner()) return value_or_throw(local_copy(timeout));
    Future<Message> reply = internal::rref_fetch(state_, TypeName<T>::get(), timeout);
    return value_or_throw(internal::decode_reply<T>(reply.result()));
  }

  // On the owner: the value itself, for functions that run there (waits until it has
  // been created). The reference is valid while this RRef or a copy of it lives; the
  // value may be used from several threads at once (guard it as you would any shared
  // object). Throws RpcError: kFailedPrecondition on any other worker, or the
  // creation's error.
  T& local_value() const {
    std::shared_ptr<void> object =
        value_or_throw(internal::rref_local_value(*state_, TypeName<T>::get(), std::nullopt));
    return *static_cast<T*>(object.get());
  }

  // Calls `fn` on the owner with this RRef as its first argument (where local_value()
  // gives the value) and `args` converted to fn's other declared types. A per-call
  // RpcTimeout may come first, as for ferry::rpc_async.
  template <typename R, typename... A, typename... Ts>
  requires(!internal::kFirstIsTimeout<Ts...>) Future<internal::WireOf<R>> rpc_async(
      const RemoteFunction<R(RRef<T>, A...)>& fn, Ts&&... args)
  const { return call_async_through(fn, std::nullopt, std::forward<Ts>(args)...); }
  template <typename R, typename... A, typename... Ts>
  Future<internal::WireOf<R>> rpc_async(const RemoteFunction<R(RRef<T>, A...)>& fn, RpcTimeout timeout,
                                        Ts&&... args) const {
    return call_async_through(fn, timeout.value, std::forward<Ts>(args)...);
  }
  // rpc_async(), waited for; throws RpcError on failure.
  template <typename R, typename... A, typename... Ts>
  requires(!internal::kFirstIsTimeout<Ts...>) R rpc_sync(const RemoteFunction<R(RRef<T>, A...)>& fn, Ts&&... args)
  const {
    std::shared_ptr<RpcAgent> agent = value_or_throw(internal::rref_agent(*state_));
    return call_sync(*agent, owner().name, fn, std::nullopt, *this, std::forward<Ts>(args)...);
  }
  template <typename R, typename... A, typename... Ts>
  R rpc_sync(const RemoteFunction<R(RRef<T>, A...)>& fn, RpcTimeout timeout, Ts&&... args) const {
    std::shared_ptr<RpcAgent> agent = value_or_throw(internal::rref_agent(*state_));
    return call_sync(*agent, owner().name, fn, timeout.value, *this, std::forward<Ts>(args)...);
  }

  // cereal: an RRef in a call's arguments.
  void save(PayloadWriter& writer) const { internal::rref_save(writer, state_, TypeName<T>::get()); }
  void load(PayloadReader& reader) { state_ = internal::rref_load(reader, TypeName<T>::get()); }

 private:
  friend struct internal::RRefAccess<T>;
  explicit RRef(std::shared_ptr<internal::RRefState> state) : state_(std::move(state)) {}

  template <typename R, typename... A, typename... Ts>
  Future<internal::WireOf<R>> call_async_through(const RemoteFunction<R(RRef<T>, A...)>& fn,
                                                 std::optional<std::chrono::milliseconds> timeout, Ts&&... args) const {
    absl::StatusOr<std::shared_ptr<RpcAgent>> agent = internal::rref_agent(*state_);
    if (!agent.ok()) return make_ready_future<internal::WireOf<R>>(agent.status());
    return call_async(**agent, owner().name, fn, timeout, *this, std::forward<Ts>(args)...);
  }

  absl::StatusOr<T> local_copy(std::optional<std::chrono::milliseconds> timeout) const {
    absl::StatusOr<std::shared_ptr<void>> object = internal::rref_local_value(*state_, TypeName<T>::get(), timeout);
    if (!object.ok()) return object.status();
    return internal::copy_value(*static_cast<const T*>(object->get()));
  }

  std::shared_ptr<internal::RRefState> state_;
};

template <typename T>
struct TypeName<RRef<T>> {
  static std::string get() { return "RRef<" + TypeName<T>::get() + ">"; }
};

namespace internal {
template <typename T>
struct RRefAccess {
  static RRef<T> make(std::shared_ptr<RRefState> state) { return RRef<T>(std::move(state)); }
};
}  // namespace internal

// An RRef to `value`, owned by this worker (which must have started: init_rpc).
// Throws RpcError (kFailedPrecondition) before init_rpc.
template <typename T>
RRef<T> make_local_rref(T value) {
  OwnedValue owned;
  owned.object = std::make_shared<T>(std::move(value));
  owned.type = TypeName<T>::get();
  if constexpr (cereal::traits::is_output_serializable<T, PayloadWriter>::value) {
    owned.save = &internal::save_owned<T>;
  }
  return internal::RRefAccess<T>::make(internal::rref_make_local(std::move(owned)));
}

// Runs `fn` on worker `to` with `args` (converted to fn's declared types) and returns
// a reference to its result, which stays on `to`. Returns at once; the result is
// created on `to` in the background (on this worker, when `to` is this worker, before
// remote returns). Any error (unknown worker, no worker started, the function failing
// or unknown there) comes out of to_here() and the calls through the RRef.
template <typename T, typename... A, typename... Ts>
RRef<T> remote(std::string_view to, const RemoteFunction<T(A...)>& fn, Ts&&... args) {
  static_assert(internal::ArgumentCheck<std::tuple<A...>, Ts...>::value);
  if constexpr (internal::ArgumentCheck<std::tuple<A...>, Ts...>::value) {
    // The conversions happen here; the writer runs before remote() returns.
    return internal::RRefAccess<T>::make(internal::rref_remote(
        to, TypeName<T>::get(), fn.name(), fn.signature(),
        [&](PayloadWriter& w) { (w(internal::convert_argument<A>(std::forward<Ts>(args))), ...); }));
  }
}

// The string form: the call's signature is made from T and the exact types of `args`.
template <typename T, typename... Args>
RRef<T> remote(std::string_view to, std::string_view fn, const Args&... args) {
  return internal::RRefAccess<T>::make(internal::rref_remote(to, TypeName<T>::get(), fn,
                                                             internal::cached_call_signature<T, Args...>(),
                                                             [&](PayloadWriter& w) { (w(args), ...); }));
}

}  // namespace ferry
