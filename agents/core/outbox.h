// File: agents/core/outbox.h
//
// Outbox: the calls one agent makes (agents/core/agent.h) and their replies. A call
// is checked against the membership and the lost peers, its device tensors staged
// through the peer's channel (a tensor the map cannot place fails here, before
// anything is sent), registered in the call table with its deadline, and written on
// the peer's link. A reply completes its call; one whose tensors land on a device
// completes on the pool, since a device copy must not run on a transport thread.
//
// It calls only what is below it and reports upward through one callback: a peer
// whose reply did not parse is lost.
//
// Threads: send() on any thread; on_reply() on transport threads.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "agents/core/membership.h"
#include "agents/core/transport.h"
#include "agents/rpc_agent.h"
#include "base/future.h"
#include "serialization/message.h"
#include "stats/stats.h"
#include "trace/trace.h"

namespace ferry::internal {

class CallTable;
class Channels;
class JoinBarrier;
class Links;
class ThreadPool;

class Outbox {
 public:
  // Everything referenced outlives it; `owner` keeps it alive while a pool task of its
  // own runs. `lost(peer, why)` runs on a transport or pool thread.
  Outbox(WorkerInfo self, std::chrono::milliseconds default_timeout, const Membership& members, JoinBarrier& fates,
         Channels& channels, CallTable& calls, Links& links, ThreadPool& pool, AgentStats& stats,
         TraceRecorder* trace, std::weak_ptr<void> owner, std::function<void(int, absl::Status)> lost);

  // Sends `message` to worker `to`; the future completes with its reply or why not.
  Future<Message> send(int to, Message message, std::optional<std::chrono::milliseconds> timeout);
  // The same, to a worker resolve() gave: looked up once, unless the membership
  // changed since.
  absl::StatusOr<Destination> resolve(std::string_view name) const;
  Future<Message> send(const Destination& to, Message message, std::optional<std::chrono::milliseconds> timeout);
  // A reply (kResponse, kError or kBusy) from `peer`.
  void on_reply(int peer, Wire wire);
  // Later calls fail with kCancelled; calls made meanwhile too.
  void stop() { stopped_.store(true, std::memory_order_release); }
  bool stopped() const { return stopped_.load(std::memory_order_relaxed); }

 private:
  Future<Message> send(const Member& peer, Message message, std::optional<std::chrono::milliseconds> timeout);
  void complete(int peer, std::vector<std::string> targets, absl::StatusOr<Message> reply);

  const WorkerInfo self_;
  const std::chrono::milliseconds default_timeout_;
  const Membership& members_;
  JoinBarrier& fates_;
  Channels& channels_;
  CallTable& calls_;
  Links& links_;
  ThreadPool& pool_;
  AgentStats& stats_;
  TraceRecorder* const trace_;
  const std::weak_ptr<void> owner_;
  const std::function<void(int, absl::Status)> lost_;
  std::atomic<bool> stopped_{false};
};

}  // namespace ferry::internal
