// File: rpc/function_registry.h
//
// The process-wide registry of functions other workers may call by name. Any callable
// whose arguments and result are cereal-serializable can be registered (scalars,
// strings, Tensor, and these nested in vector, map, optional, tuple and user structs
// with a `serialize` method). A function may also return absl::Status (no value) or
// absl::StatusOr<R> to fail without throwing; a function that throws fails the
// caller's future with the remote worker's name and the exception's message.
//
//   FERRY_RETURN_IF_ERROR(ferry::register_function("add", [](int64_t a, int64_t b) { return a + b; }));
//   FERRY_RETURN_IF_ERROR(ferry::register_function("scale", [](ferry::Tensor t, double s) { return t.mul(s); }));
//
// Every call carries the signature its caller used, e.g. "(int64, int64) -> int64";
// a call whose signature differs from the registered one fails with both named.
//
// Where a function runs: by default on the worker pool, where it may block and make
// calls of its own. A function registered with Serving::kInline runs right on the
// thread that received the call, with no hand-off, so a call to it costs about what a
// raw message round trip costs. That is the transport's thread, or, over the ring, an
// idle pool thread that polls the rings (base/progress.h); never a user's thread that
// delivers messages while it waits for a reply (the request goes to the pool then). It
// MUST NOT BLOCK (no waiting, no I/O, no locks held for long): the transport stops
// while it runs. Calls it makes
// (rpc_sync, rpc_async, remote, RRef arguments that must notify their owner) fail at
// once with kFailedPrecondition. Calls carrying CUDA tensors still go to the pool.
//
//   FERRY_RETURN_IF_ERROR(ferry::register_function("get_step", [&] { return step.load(); },
//                                                  ferry::Serving::kInline));
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/future.h"
#include "serialization/message.h"
#include "serialization/types.h"

namespace ferry {

// Marks a function without a result (rpc_sync<void>, or a function returning void or
// absl::Status).
struct Void {
  template <class Archive>
  void serialize(Archive&) {}
};
template <>
struct TypeName<Void> {
  static std::string get() { return "void"; }
};

namespace internal {

template <typename T>
struct CallableTraits : CallableTraits<decltype(&T::operator())> {};
template <typename R, typename... A>
struct CallableTraits<R (*)(A...)> {
  using Result = R;
  using Args = std::tuple<std::decay_t<A>...>;
};
template <typename R, typename... A>
struct CallableTraits<R(A...)> : CallableTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct CallableTraits<R (C::*)(A...)> : CallableTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct CallableTraits<R (C::*)(A...) const> : CallableTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct CallableTraits<R (C::*)(A...) noexcept> : CallableTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct CallableTraits<R (C::*)(A...) const noexcept> : CallableTraits<R (*)(A...)> {};

// The value type a function's result travels as: R, or U for StatusOr<U>, or Void.
template <typename R>
struct WireResult {
  using type = R;
};
template <>
struct WireResult<void> {
  using type = Void;
};
template <>
struct WireResult<absl::Status> {
  using type = Void;
};
template <typename U>
struct WireResult<absl::StatusOr<U>> {
  using type = U;
};

template <typename Tuple>
struct TupleSignature;
template <typename... A>
struct TupleSignature<std::tuple<A...>> {
  static const std::string& get() { return signature<A...>(); }
};

// "(int64, int64) -> int64".
template <typename R, typename... Args>
std::string call_signature() {
  return signature<Args...>() + " -> " + TypeName<R>::get();
}

}  // namespace internal

// A function's result kept as a live object on the worker that ran it: the value an
// RRef (rpc/rref.h) refers to. `save` writes the object (a `type`) into a payload;
// null when the type cannot be serialized.
struct OwnedValue {
  std::shared_ptr<void> object;
  std::string type;
  void (*save)(PayloadWriter& writer, const void* object) = nullptr;
};

// A registered function with its types erased. `invoke` reads the arguments from
// `args` (positioned after the call header) and writes the result into `response`.
// `make_value` reads the arguments the same way and keeps the result as an OwnedValue
// (for remote(), rpc/rref.h).
// Where a registered function runs (see the file comment).
enum class Serving {
  kPool,    // on the worker pool: may block and make calls
  kInline,  // on the transport's (or an idle pool) thread: must not block; makes no calls
};

struct RegisteredFunction {
  std::string signature;
  Serving serving = Serving::kPool;
  std::function<absl::Status(PayloadReader& args, Message& response)> invoke;
  std::function<absl::StatusOr<OwnedValue>(PayloadReader& args)> make_value;
};

// Names starting with this prefix are ferry's own (e.g. "ferry::rref::fetch");
// register_function refuses them.
inline constexpr char kReservedFunctionPrefix[] = "ferry::";

// A function every worker serves, with signature "(string) -> string": the signature
// of the function registered there under the name it is given (kNotFound when none
// is). Callers without C++ types (the Python package, python/) learn from it how to
// encode a call.
inline constexpr char kSignatureOfFunction[] = "ferry::signature_of";

// Thread-safe: registration and lookup may happen from any thread at any time.
class FunctionRegistry {
 public:
  // The registry the free functions and every agent of this process use.
  static FunctionRegistry& global();

  // Errors: kAlreadyExists when `name` is taken; kInvalidArgument for an empty name or
  // one starting with kReservedFunctionPrefix.
  absl::Status add(std::string name, RegisteredFunction function);
  // Removes `name`; returns whether it was there.
  bool remove(std::string_view name);
  // The function, or null. The pointer stays valid until the name is removed.
  std::shared_ptr<const RegisteredFunction> find(std::string_view name) const;
  // Whether any function registered now is served inline (Serving::kInline).
  bool has_inline_functions() const;

  FunctionRegistry();
  ~FunctionRegistry();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Wraps `fn` for the registry.
namespace internal {
template <typename Args>
absl::Status read_arguments(PayloadReader& reader, Args& args) {
  return read_guarded("arguments", [&] {
    std::apply([&](auto&... a) { (reader(a), ...); }, args);
    if (reader.remaining() != 0) {
      throw cereal::Exception(absl::StrCat(reader.remaining(), " unexpected bytes after the arguments"));
    }
  });
}

// Keeps a function's result as a live object (see OwnedValue).
template <typename Wire, typename V>
absl::StatusOr<OwnedValue> own_value(V&& value) {
  OwnedValue out;
  out.object = std::make_shared<Wire>(std::forward<V>(value));
  out.type = TypeName<Wire>::get();
  out.save = [](PayloadWriter& w, const void* object) { w(*static_cast<const Wire*>(object)); };
  return out;
}
}  // namespace internal

template <typename F>
RegisteredFunction make_registered_function(F fn, Serving serving = Serving::kPool) {
  using Traits = internal::CallableTraits<std::decay_t<F>>;
  using Result = typename Traits::Result;
  using Args = typename Traits::Args;
  using Wire = typename internal::WireResult<Result>::type;
  RegisteredFunction out;
  out.signature = internal::TupleSignature<Args>::get() + " -> " + TypeName<Wire>::get();
  out.serving = serving;
  auto shared = std::make_shared<F>(std::move(fn));
  out.make_value = [shared](PayloadReader& reader) -> absl::StatusOr<OwnedValue> {
    F& fn = *shared;
    Args args;
    FERRY_RETURN_IF_ERROR(internal::read_arguments(reader, args));
    if constexpr (std::is_void_v<Result>) {
      std::apply(fn, std::move(args));
      return internal::own_value<Void>(Void{});
    } else if constexpr (std::is_same_v<Result, absl::Status>) {
      absl::Status s = std::apply(fn, std::move(args));
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat("failed: ", s.message()));
      return internal::own_value<Void>(Void{});
    } else if constexpr (internal::IsStatusOr<Result>::value) {
      Result r = std::apply(fn, std::move(args));
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat("failed: ", r.status().message()));
      return internal::own_value<Wire>(*std::move(r));
    } else {
      return internal::own_value<Wire>(std::apply(fn, std::move(args)));
    }
  };
  out.invoke = [shared](PayloadReader& reader, Message& response) -> absl::Status {
    F& fn = *shared;
    Args args;
    absl::Status decoded = internal::read_arguments(reader, args);
    if (!decoded.ok()) return decoded;
    PayloadWriter writer(response);
    if constexpr (std::is_void_v<Result>) {
      std::apply(fn, std::move(args));
      writer(Void{});
    } else if constexpr (std::is_same_v<Result, absl::Status>) {
      absl::Status s = std::apply(fn, std::move(args));
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat("failed: ", s.message()));
      writer(Void{});
    } else if constexpr (internal::IsStatusOr<Result>::value) {
      Result r = std::apply(fn, std::move(args));
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat("failed: ", r.status().message()));
      writer(*r);
    } else {
      writer(std::apply(fn, std::move(args)));
    }
    return absl::OkStatus();
  };
  return out;
}

// Registers `fn` under `name` in the process's registry, to run where `serving` says.
// Errors: kAlreadyExists when the name is taken.
template <typename F>
[[nodiscard]] absl::Status register_function(std::string name, F fn, Serving serving = Serving::kPool) {
  return FunctionRegistry::global().add(std::move(name), make_registered_function(std::move(fn), serving));
}

// Whether `request` calls a function of `registry` registered with Serving::kInline.
// Quick and non-blocking: agents ask it on their transport threads.
bool serves_inline(const FunctionRegistry& registry, const Message& request);

// Finds `name` in `registry` and checks that the call's `signature` is its own; the
// errors (kNotFound, kInvalidArgument) name worker `self_name` as dispatch_request's do.
absl::StatusOr<std::shared_ptr<const RegisteredFunction>> find_function(const FunctionRegistry& registry,
                                                                        std::string_view self_name,
                                                                        std::string_view name,
                                                                        std::string_view signature);

// Runs `body` (which invokes function `name`) and turns an exception or an error status
// into a status naming worker `self_name` and the function, as dispatch_request does.
template <typename Body>
absl::Status run_function_guarded(std::string_view self_name, std::string_view name, Body&& body) {
  absl::Status s;
  try {
    s = body();
  } catch (const std::exception& e) {
    s = absl::UnknownError(absl::StrCat("threw ", internal::demangle(typeid(e).name()), ": ", e.what()));
  } catch (...) {
    s = absl::UnknownError("threw a non-standard exception");
  }
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(internal::av(self_name), ": function \"", internal::av(name), "\" ",
                                             s.message()));
}

// Runs the request `request` against `registry` on behalf of worker `self_name` and
// returns the reply: a kResponse, or a kError naming this worker (unknown function,
// signature mismatch, undecodable arguments, a thrown exception or an error status).
// Never throws.
Message dispatch_request(const FunctionRegistry& registry, std::string_view self_name, const Message& request);

}  // namespace ferry
