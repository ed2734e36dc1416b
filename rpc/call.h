// File: rpc/call.h
//
// Typed calls on an explicit agent: the building blocks of rpc_sync / rpc_async
// (rpc/rpc.h), for programs (and tests) that run several agents in one process.
//
//   Future<int64_t> f = call_async<int64_t>(*agent, "worker1", "add", std::nullopt, int64_t{1}, int64_t{2});
//   int64_t v = call_sync<int64_t>(*agent, "worker1", "add", std::chrono::seconds(5), int64_t{1}, int64_t{2});
//
// The call's signature is made from the C++ types of `args` and R exactly as given
// (1 is an int32, int64_t{1} an int64), and must match the registered function's.
// Typed handles (rpc/remote_function.h) convert the arguments for you.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/rpc_agent.h"
#include "base/future.h"
#include "base/status.h"
#include "rpc/function_registry.h"
#include "rpc/outgoing_call.h"
#include "serialization/types.h"

namespace ferry {

namespace internal {

template <typename R>
using WireOf = std::conditional_t<std::is_void_v<R>, Void, R>;

template <typename R, typename... Args>
const std::string& cached_call_signature() {
  static const std::string text = signature<Args...>() + " -> " + TypeName<WireOf<R>>::get();
  return text;
}

// Writes a string the way cereal writes std::string, without building one.
inline void write_string(PayloadWriter& w, std::string_view s) {
  w(cereal::make_size_tag(static_cast<cereal::size_type>(s.size())));
  w.save_binary(s.data(), s.size());
}

template <typename R, typename... Args>
Message make_request(std::string_view fn, size_t inline_bytes, const Args&... args) {
  Message m(MessageType::kRequest, 0);
  PayloadWriter w(m, inline_bytes);
  write_string(w, fn);
  m.set_function_size(fn.size());
  write_string(w, cached_call_signature<R, Args...>());
  (w(args), ...);
  return m;
}

// Why a call cannot go out, as the agent's membership says: the worker is unknown
// (kNotFound), or it left the group or was lost (kUnavailable).
inline absl::Status no_such_worker(const RpcAgent& agent, const absl::Status& why) {
  return absl::Status(why.code(), absl::StrCat("rpc from \"", agent.self().name, "\": ", why.message()));
}

// make_request, with an argument that refuses to be written (an RRef outside a call
// it can travel in) reported as kInvalidArgument naming the function.
template <typename R, typename... Args>
absl::StatusOr<Message> make_request_checked(std::string_view fn, const Args&... args) {
  try {
    return make_request<R>(fn, inline_tensor_bytes(), args...);
  } catch (const cereal::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("call to \"", av(fn), "\": cannot send its arguments: ", e.what()));
  }
}

template <typename R>
absl::StatusOr<WireOf<R>> decode_reply(const absl::StatusOr<Message>& reply) {
  if (!reply.ok()) return reply.status();
  absl::StatusOr<std::tuple<WireOf<R>>> v = read_payload<WireOf<R>>(*reply, "reply");
  if (!v.ok()) return v.status();
  return std::get<0>(*std::move(v));
}

}  // namespace internal

// Calls `fn` on worker `to` through `agent`. Continuations (then(), add_callback())
// run on the agent's pool, never on a transport thread, so they may block and may
// call rpc_sync themselves. Errors: kNotFound for an
// unknown worker or function, kUnavailable for one that left or was lost, kInvalidArgument for a signature mismatch,
// kDeadlineExceeded after `timeout` (none: the agent's default; zero: no timeout),
// kUnavailable when the worker is lost, and the remote function's own errors, whose
// messages name the worker they came from.
template <typename R, typename... Args>
Future<internal::WireOf<R>> call_async(RpcAgent& agent, std::string_view to, std::string_view fn,
                                       std::optional<std::chrono::milliseconds> timeout, const Args&... args) {
  using W = internal::WireOf<R>;
  absl::StatusOr<Destination> dst = agent.resolve(to);
  if (!dst.ok()) return make_ready_future<W>(internal::no_such_worker(agent, dst.status()));
  internal::OutgoingCall call(agent, dst->id());
  absl::StatusOr<Message> request = internal::make_request_checked<R>(fn, args...);
  if (!request.ok()) return make_ready_future<W>(request.status());
  std::vector<std::shared_ptr<const void>> keep = call.take_keep_alive();
  Future<Message> reply = agent.send(*dst, *std::move(request), timeout);
  // Decoding never blocks, so it may run on the transport thread; the user's own
  // continuations on the returned future still run on the agent's pool.
  if (keep.empty()) {
    return reply.then_inline([](const absl::StatusOr<Message>& r) { return internal::decode_reply<R>(r); });
  }
  // What the arguments asked to keep alive (RRefs they carry) is held until the reply.
  return reply.then_inline([keep = std::move(keep)](const absl::StatusOr<Message>& r) {
    return internal::decode_reply<R>(r);
  });
}

// Blocking form of call_async; throws RpcError carrying the status on failure.
template <typename R, typename... Args>
R call_sync(RpcAgent& agent, std::string_view to, std::string_view fn,
            std::optional<std::chrono::milliseconds> timeout, const Args&... args) {
  absl::StatusOr<Destination> dst = agent.resolve(to);
  if (!dst.ok()) throw RpcError(internal::no_such_worker(agent, dst.status()));
  internal::OutgoingCall call(agent, dst->id());
  absl::StatusOr<Message> request = internal::make_request_checked<R>(fn, args...);
  if (!request.ok()) throw RpcError(request.status());
  // Wait on the reply itself and decode here: no continuation, no extra future.
  Future<Message> reply = agent.send(*dst, *std::move(request), timeout);
  absl::StatusOr<internal::WireOf<R>> value = internal::decode_reply<R>(reply.result());
  if (!value.ok()) throw RpcError(value.status());
  if constexpr (!std::is_void_v<R>) return *std::move(value);
}

}  // namespace ferry
