// File: agents/core/server.h
//
// Server: serving the requests peers send to one agent (agents/core/agent.h). A
// request is decoded on the transport thread; pings are answered there, without user
// code; the rest run on the worker pool (or right there, for a function registered as
// inline), each handed its caller's entry in the membership. A reply goes back on the
// connection its request came on, now or later (defer_reply, agents/rpc_agent.h).
// Requests are refused unrun when the worker is leaving, when their caller has more
// than max_requests_in_flight here, and when they waited past their caller's timeout.
//
// It calls only what is below it: the links (for the cap's flow control), the device
// channels, the membership, the pool and the call table's timer.
//
// Threads: on_request on transport threads; handlers, and the replies they send, on
// pool threads (or any thread, for a deferred reply).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agents/core/channels.h"
#include "agents/core/lock_order.h"
#include "agents/core/membership.h"
#include "agents/core/transport.h"
#include "agents/rpc_agent.h"
#include "stats/stats.h"
#include "trace/trace.h"

namespace ferry::internal {

class Activity;
class CallTable;
class Links;
class ThreadPool;

class Server {
 public:
  struct Settings {
    // Requests served on the transport thread that received them; unset: none.
    InlineFilter serves_inline;
    // For the message of a request refused at the cap (Links::take_request).
    int max_requests_in_flight = 1024;
  };
  // Everything referenced outlives the server; `owner` keeps it alive while a pool or
  // timer task of its own runs.
  Server(WorkerInfo self, RequestHandler handler, Settings settings, Links& links, Channels& channels,
         const Membership& members, ThreadPool& pool, std::shared_ptr<Activity> activity, CallTable& timer, AgentStats& stats,
         TraceRecorder* trace, std::weak_ptr<void> owner);

  // A request (kRequest, kControl or kPing) read from `from`.
  void on_request(const std::shared_ptr<Connection>& from, Wire wire);
  // Serves kControl requests (a membership protocol); without one they get an error.
  void set_control_handler(RequestHandler handler);
  // From now on new requests get kUnavailable saying this worker is leaving.
  void refuse_requests() { refusing_.store(true, std::memory_order_release); }
  uint64_t served() const { return served_.load(std::memory_order_relaxed); }

  // What the statistics and the trace keep of a request until its reply goes.
  struct Served {
    AgentStats::Request observed;
    AgentStats::Clock::time_point started;  // its handler's start (traced only)
    std::string function;                   // traced only
  };
  // The request a pool thread is serving, for defer_reply().
  struct Serving {
    std::shared_ptr<Connection> from;
    std::shared_ptr<const Membership::Table> table;  // keeps `member` alive
    const Member* member;
    WorkerInfo caller;
    uint64_t id;
    bool counted;
    Served served;
    bool deferred = false;
    Server* server = nullptr;
  };
  DeferredReply defer(Serving& request, std::optional<std::chrono::milliseconds> timeout);

 private:
  void serve(const std::shared_ptr<Connection>& from, std::vector<std::string> targets, Message request,
             std::chrono::steady_clock::time_point arrived, AgentStats::Request observed);
  // Stages the reply's tensors back through the caller's channel and writes it on
  // `from`. `member` (null for a caller not in the table) must outlive the call.
  // `counted`: a kRequest, counted in its connection's serving until now.
  void send_reply(const std::shared_ptr<Connection>& from, const Member* member, const WorkerInfo& caller,
                  uint64_t id, bool counted, const Served& served, Message reply);
  Message run_handler(const Message& request, const WorkerInfo& caller);

  const WorkerInfo self_;
  const RequestHandler handler_;
  const Settings settings_;
  Links& links_;
  Channels& channels_;
  const Membership& members_;
  ThreadPool& pool_;
  const std::shared_ptr<Activity> activity_;
  CallTable& timer_;
  AgentStats& stats_;
  TraceRecorder* const trace_;
  const std::weak_ptr<void> owner_;

  RankedMutex hooks_mu_{LockRank::kHooks};
  std::shared_ptr<const RequestHandler> control_handler_ ABSL_GUARDED_BY(hooks_mu_);
  std::atomic<bool> refusing_{false};
  std::atomic<uint64_t> served_{0};
};

}  // namespace ferry::internal
