// File: agents/rpc_agent.h
//
// RpcAgent: what moves messages between the workers of a job. It sends a request to
// a worker and hands back a future of the reply; it receives requests and runs them
// through the request handler it was given at construction (the rpc layer's function
// registry), on its own pool of worker threads. Agents never call up into rpc/.
//
//   std::shared_ptr<RpcAgent> agent = ...;   // e.g. TensorPipeAgent::create(...)
//   Future<Message> reply = agent->send(agent->worker_info("worker1")->id, std::move(request));
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/future.h"
#include "serialization/message.h"

namespace ferry {

// A worker of the group: its unique name and its id (its rank in a static group).
struct WorkerInfo {
  std::string name;
  int id = -1;

  friend bool operator==(const WorkerInfo&, const WorkerInfo&) = default;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, id);
  }
};

// Runs one request and returns its reply (kResponse or kError). Called on one of the
// agent's worker threads, never on a transport thread; may block (a user function
// runs inside it) and may be called concurrently from several threads.
using RequestHandler = std::function<Message(const Message& request, const WorkerInfo& from)>;

// A reply that a request handler gives later, from any thread, instead of returning
// it: the handler calls defer_reply() on the thread running it, returns any message
// (it is ignored), and the reply goes to the caller when send() is called, so no pool
// thread waits meanwhile. Copies share one reply. Thread-safe.
class DeferredReply {
 public:
  struct State;  // the agent's

  // An invalid reply (valid() is false); send() does nothing.
  DeferredReply() = default;
  explicit DeferredReply(std::shared_ptr<State> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  // Sends `reply` (kResponse or kError; the agent sets its id) to the caller, once:
  // later calls, and calls after the deadline passed, do nothing. Never blocks and may
  // run on any thread, a future's callback included. When every copy is gone unsent,
  // the caller gets kInternal saying the reply was dropped.
  void send(Message reply) const;

 private:
  std::shared_ptr<State> state_;
};

// On a thread running a RequestHandler, for the request it runs: the reply goes
// later, through the result (see DeferredReply). The agent counts the request as in
// flight until then (join() waits for it); if no reply was sent within `timeout`
// (none: never), the caller gets kDeadlineExceeded. Anywhere else: an invalid reply,
// and the handler's return value is the reply as usual.
DeferredReply defer_reply(std::optional<std::chrono::milliseconds> timeout);

// Whether `request` may be served right on the transport thread that received it,
// with no hop to the worker pool: only when its handler never blocks (it then runs
// there, and any call it tries to make fails at once). Called on transport threads;
// must be quick, must not block, and may be called concurrently.
using InlineFilter = std::function<bool(const Message& request)>;

// What happened to a worker, as told to membership listeners.
enum class MembershipChange {
  kJoined,  // it joined the group (dynamic groups)
  kLeft,    // it left the group on purpose (dynamic groups: shutdown)
  kLost,    // its connection failed: it died or became unreachable
};

// Called with the worker concerned and what happened to it.
using MembershipListener = std::function<void(const WorkerInfo& worker, MembershipChange change)>;

// A worker a call goes to, looked up once by name (RpcAgent::resolve) and handed to
// send(), so that a call resolves its destination once. It holds what the agent
// resolved (ferry's agent: the worker's entry in the membership of that moment, which
// it keeps alive); meant for one call, not to be kept (an agent that sees the
// membership changed since looks the worker up again by id).
class Destination {
 public:
  // `info` points into `entry`, which `resolver` (the agent) made at membership
  // version `version`.
  Destination(const WorkerInfo* info, std::shared_ptr<const void> entry, const void* resolver, uint64_t version)
      : info_(info), entry_(std::move(entry)), resolver_(resolver), version_(version) {}

  const WorkerInfo& info() const { return *info_; }
  int id() const { return info_->id; }
  const void* entry() const { return entry_.get(); }
  const void* resolver() const { return resolver_; }
  uint64_t version() const { return version_; }

 private:
  const WorkerInfo* info_;
  std::shared_ptr<const void> entry_;
  const void* resolver_;
  uint64_t version_;
};

// Thread-safe: every method may be called from any thread.
class RpcAgent {
 public:
  virtual ~RpcAgent() = default;

  // Sends `message` (a kRequest) to worker `to` and returns a future of its reply.
  // Its callbacks run on the agent's pool, never on a transport thread (see
  // base/future.h). It completes with the kResponse message, or with an error status: the remote error (kError reply), kDeadlineExceeded after `timeout`
  // (none: the agent's default; zero: no timeout), kUnavailable when the peer is lost
  // (at once, not at the timeout), kCancelled when the agent shuts down first,
  // kNotFound for an unknown worker id, kUnavailable for one that left or was lost. The
  // message's id is assigned by the agent.
  virtual Future<Message> send(int to, Message message,
                               std::optional<std::chrono::milliseconds> timeout = std::nullopt) = 0;
  // The worker named `name`, looked up once for send(const Destination&); kNotFound
  // (kUnavailable for one that left or was lost) as worker_info(name).
  virtual absl::StatusOr<Destination> resolve(std::string_view name) const {
    absl::StatusOr<WorkerInfo> info = worker_info(name);
    if (!info.ok()) return info.status();
    auto owned = std::make_shared<const WorkerInfo>(*std::move(info));
    return Destination(owned.get(), owned, nullptr, 0);
  }
  // send() to a worker resolve() gave, without looking it up again.
  virtual Future<Message> send(const Destination& to, Message message,
                               std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
    return send(to.id(), std::move(message), timeout);
  }

  virtual const WorkerInfo& self() const = 0;
  // kNotFound when no worker has that name / id.
  virtual absl::StatusOr<WorkerInfo> worker_info(std::string_view name) const = 0;
  virtual absl::StatusOr<WorkerInfo> worker_info(int id) const = 0;
  virtual std::vector<WorkerInfo> worker_infos() const = 0;

  // The default per-call timeout (zero: none).
  virtual std::chrono::milliseconds default_timeout() const = 0;

  // Waits until every worker of the group has called join and no worker has calls in
  // flight (this worker keeps serving requests meanwhile); in a dynamic group, leaves
  // it instead. Errors: kDeadlineExceeded after `timeout`, kUnavailable if the store
  // is lost, kFailedPrecondition when this worker may not leave yet (it stays up).
  virtual absl::Status join(std::chrono::milliseconds timeout) = 0;
  // Waits until this worker's own calls in flight are done.
  virtual absl::Status sync(std::chrono::milliseconds timeout) = 0;
  // Stops the agent: pending calls fail with kCancelled, threads are joined. Idempotent.
  // A graceful shutdown calls join() first. Must be called from a thread the agent does
  // not own (not from a user function or a future callback): it would join itself, so
  // such a call is logged and ignored.
  virtual void shutdown() = 0;

  // Registers `listener` for every later change of membership. It runs on one of the
  // agent's pool threads (never a transport thread), one change at a time, and may call
  // the agent. Listeners live as long as the agent. An agent that cannot tell (a custom
  // backend that keeps the default) never calls it.
  virtual void add_membership_listener(MembershipListener listener) { (void)listener; }

  // Keeps checking that worker `peer` is alive while `watched` (say false when done), as
  // if calls to it were pending: one that stops answering is lost, and listeners hear
  // it. For state a peer holds here without calls in either direction (RRef forks). An
  // agent without heartbeats (the default) ignores it.
  virtual void watch(int peer, bool watched) {
    (void)peer;
    (void)watched;
  }

  // Counters for debugging: calls in flight, pool size, requests served, ...
  virtual std::map<std::string, std::string> debug_info() const = 0;
};

}  // namespace ferry
