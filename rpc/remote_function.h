// File: rpc/remote_function.h
//
// Typed handles to registered functions. Registering returns a RemoteFunction that
// knows the function's result and argument types; a caller in another process can
// declare the same handle from the name. A call through a handle converts its
// arguments to the declared types at compile time, as calling a C++ function would:
// a wrong number of arguments, or one that does not convert, does not compile.
//
//   // on every worker (usually the same binary):
//   FERRY_ASSIGN_OR_RETURN(auto add, ferry::register_remote_function("add", [](int64_t a, int64_t b) {
//     return a + b;
//   }));
//   // or, where the function is not registered, from its name:
//   ferry::RemoteFunction<int64_t(int64_t, int64_t)> add("add");
//   int64_t three = ferry::rpc_sync("worker1", add, 1, 2);       // 1 and 2 become int64_t
//   ferry::rpc_sync("worker1", add, 1);                          // does not compile
//
// A function that returns absl::StatusOr<U> has the handle U(Args...); one that
// returns void or absl::Status has void(Args...). Argument types are declared without
// const or references. The string form (rpc_sync<R>("worker1", "add", ...)) stays.
// The run-time signature check still applies: a handle declared with other types than
// the function was registered with fails with both signatures named.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/status/statusor.h"
#include "agents/rpc_agent.h"
#include "base/future.h"
#include "rpc/call.h"
#include "rpc/function_registry.h"

namespace ferry {

template <typename Signature>
class RemoteFunction;

// A handle to the function registered as `name()` with result R and arguments A....
// A value type (it holds only the name); thread-safe to share.
template <typename R, typename... A>
class RemoteFunction<R(A...)> {
  static_assert((std::is_same_v<A, std::decay_t<A>> && ...),
                "ferry::RemoteFunction: declare argument types without const or references, e.g. "
                "RemoteFunction<double(Tensor, int64_t)>");
  static_assert(std::is_same_v<R, std::decay_t<R>>,
                "ferry::RemoteFunction: declare the result type without const or references");

 public:
  using result_type = R;
  using arguments = std::tuple<A...>;

  explicit RemoteFunction(std::string name) : name_(std::move(name)) {}

  const std::string& name() const { return name_; }
  // The signature calls through this handle carry, e.g. "(int64, int64) -> int64".
  const std::string& signature() const { return internal::cached_call_signature<R, A...>(); }

 private:
  std::string name_;
};

namespace internal {

template <typename Handle>
struct RemoteFunctionTraits;
template <typename R, typename... A>
struct RemoteFunctionTraits<RemoteFunction<R(A...)>> {
  using Result = R;
  using Args = std::tuple<A...>;
};

// The handle type make_registered_function gives `F`.
template <typename F>
struct HandleOf {
  template <typename Tuple>
  struct Make;
  template <typename... A>
  struct Make<std::tuple<A...>> {
    using Wire = typename WireResult<typename CallableTraits<std::decay_t<F>>::Result>::type;
    using R = std::conditional_t<std::is_same_v<Wire, Void>, void, Wire>;
    using type = RemoteFunction<R(A...)>;
  };
  using type = typename Make<typename CallableTraits<std::decay_t<F>>::Args>::type;
};

// Compile-time checks of a call through a handle, with messages that say what is wrong.
template <typename Declared, typename... Given>
struct ArgumentCheck;
template <typename... A, typename... Given>
struct ArgumentCheck<std::tuple<A...>, Given...> {
  static constexpr bool arity_ok = sizeof...(A) == sizeof...(Given);
  static_assert(arity_ok, "ferry: wrong number of arguments for this RemoteFunction (see its declared signature)");
  template <typename Tuple, size_t... I>
  static constexpr bool convertible(std::index_sequence<I...>) {
    return (std::is_convertible_v<std::tuple_element_t<I, Tuple>, A> && ...);
  }
  static constexpr bool value = [] {
    if constexpr (arity_ok) {
      return convertible<std::tuple<Given&&...>>(std::index_sequence_for<A...>{});
    } else {
      return false;
    }
  }();
  static_assert(!arity_ok || value,
                "ferry: an argument cannot be converted to the type this RemoteFunction declares for it");
};

// `value` as a Declared: passed through when it already is one, else converted.
template <typename Declared, typename T>
decltype(auto) convert_argument(T&& value) {
  if constexpr (std::is_same_v<std::decay_t<T>, Declared>) {
    return static_cast<const Declared&>(value);
  } else {
    return Declared(std::forward<T>(value));
  }
}

}  // namespace internal

// Registers `fn` under `name` (see register_function) and returns its typed handle.
// Errors: those of register_function.
template <typename F>
[[nodiscard]] absl::StatusOr<typename internal::HandleOf<F>::type> register_remote_function(
    std::string name, F fn, Serving serving = Serving::kPool) {
  using Handle = typename internal::HandleOf<F>::type;
  absl::Status added = FunctionRegistry::global().add(name, make_registered_function(std::move(fn), serving));
  if (!added.ok()) return added;
  return Handle(std::move(name));
}

// call_async / call_sync (rpc/call.h) through a typed handle: the arguments are
// converted to the declared types first.
template <typename R, typename... A, typename... Ts>
Future<internal::WireOf<R>> call_async(RpcAgent& agent, std::string_view to, const RemoteFunction<R(A...)>& fn,
                                       std::optional<std::chrono::milliseconds> timeout, Ts&&... args) {
  static_assert(internal::ArgumentCheck<std::tuple<A...>, Ts...>::value);
  if constexpr (internal::ArgumentCheck<std::tuple<A...>, Ts...>::value) {
    return call_async<R>(agent, to, fn.name(), timeout, internal::convert_argument<A>(std::forward<Ts>(args))...);
  }
}
template <typename R, typename... A, typename... Ts>
R call_sync(RpcAgent& agent, std::string_view to, const RemoteFunction<R(A...)>& fn,
            std::optional<std::chrono::milliseconds> timeout, Ts&&... args) {
  static_assert(internal::ArgumentCheck<std::tuple<A...>, Ts...>::value);
  if constexpr (internal::ArgumentCheck<std::tuple<A...>, Ts...>::value) {
    return call_sync<R>(agent, to, fn.name(), timeout, internal::convert_argument<A>(std::forward<Ts>(args))...);
  }
}

}  // namespace ferry
