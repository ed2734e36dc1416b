// File: agents/core/agent.h
//
// Agent: the one RpcAgent of ferry, over any Transport (agents/core/transport.h). A
// transport adapter (agents/ring/, agents/tensorpipe/, agents/process_group/,
// agents/inproc/) only moves bytes; the agent owns every protocol above it:
//   - the call table: ids, deadlines, a lost peer's calls failed at once;
//   - the job-token handshake on every connection (agents/core/handshake.h), its size
//     limits, deadline and cap on unauthenticated connections;
//   - serving: requests decoded on the transport thread, run on the worker pool,
//     replies routed back on the connection they came on (or later, defer_reply);
//     pings answered without user code; at most max_requests_in_flight requests per
//     caller in flight (the caller holds the rest, and the server stops reading a
//     connection that reaches it), and requests whose caller's timeout passed before
//     they ran dropped unrun;
//   - the membership: a versioned table that can grow and shrink while calls run,
//     and the dynamic-group protocol over it (agents/core/dynamic_group.h);
//   - heartbeats on idle peers with calls pending;
//   - device channels: CUDA tensors through the device maps (requests) and the
//     reverse maps (replies), one channel per peer (agents/core/device_channel.h);
//   - shutdown: join() on store counters and waits, teardown safe from any thread.
//
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
//       Agent::start(WorkerInfo{"worker0", 0}, store, AgentOptions{}, handler, std::move(transport)));
//   FERRY_RETURN_IF_ERROR(agent->set_members(peers));   // a static group
//
// The agent is the top of a stack of objects, each calling only those below it and
// hearing from them through one callback (a peer is lost):
//
//   Agent        start, send, the transport's events, membership, join, shutdown
//   Liveness     heartbeat pings, watched peers            (agents/core/liveness.h)
//   Server       requests, serving, deferred replies        (agents/core/server.h)
//   Outbox       calls out and their replies                (agents/core/outbox.h)
//   Links        connections, writes, pause/resume, sharing (agents/core/links.h)
//   Handshake    the job-token state machine, pure          (agents/core/handshake.h)
//   JoinBarrier  join() through the store, lost peers' fates (agents/core/join_barrier.h)
//   and below: the call table, the membership, the device channels, the pool.
//
// Their locks and the one order they are taken in: agents/core/lock_order.h.
//
// Threads: transport events arrive on transport threads and never block; user code
// (request handlers, future callbacks, membership listeners) runs on the pool; one
// timer thread fails calls at their deadline and ends handshakes that ran too long.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/core/channels.h"
#include "agents/core/handshake.h"
#include "agents/core/lock_order.h"
#include "agents/core/departures.h"
#include "agents/core/membership.h"
#include "agents/core/options.h"
#include "agents/core/transport.h"
#include "agents/rpc_agent.h"
#include "stats/stats.h"
#include "store/store.h"
#include "trace/trace.h"

namespace ferry {

namespace internal {
class Activity;
class CallTable;
class JoinBarrier;
class Links;
class Liveness;
class Outbox;
class PublishedMetrics;
class Server;
class ThreadPool;
}  // namespace internal

// Thread-safe. Owned by shared_ptr; its own threads hold only weak references, and
// shutdown() joins them all. Dropping the last reference shuts it down (not
// gracefully), from any thread — on one of its own, a thread of its own does it.
class Agent final : public RpcAgent, public TransportEvents, public std::enable_shared_from_this<Agent> {
 public:
  // Starts the pool and the timer, then the transport (listening). Members come later
  // (set_members / add_member). Errors: options out of range; the transport's.
  static absl::StatusOr<std::shared_ptr<Agent>> start(WorkerInfo self, std::shared_ptr<Store> store,
                                                      AgentOptions options, RequestHandler handler,
                                                      std::unique_ptr<Transport> transport);
  ~Agent() override;

  // The record peers reach this worker by (Transport::listen's).
  const std::string& address() const { return address_; }
  // The transport underneath, for its adapter's own queries (agents/<x>/factory.h).
  Transport& transport() { return *transport_; }
  const Transport& transport() const { return *transport_; }

  // A static group: the whole table at once, and the number of workers join() waits
  // for. No connection opens until the first call. Listeners are not told.
  // kAlreadyExists for a duplicate name or id, naming it.
  absl::Status set_members(std::vector<PeerAddress> members);
  // A worker joined: listeners are told.
  absl::Status add_member(PeerAddress member);
  // Worker `id` left (kLeft) or was lost (kLost): its pending calls fail at once saying
  // so, its connections close, later calls to it fail at once, listeners are told.
  absl::Status remove_member(int id, MembershipChange why);
  // Dynamic groups: a lost peer is removed from the membership (static: kept, marked).
  void set_dynamic(bool dynamic) { dynamic_.store(dynamic); }
  // Dynamic groups: device maps and devices change as workers join.
  void set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices);
  uint64_t membership_version() const;
  // A member that is leaving: new calls to it fail at once saying it left, the calls
  // already in flight to it may finish (at most `drain`), then it is removed as
  // remove_member(id, kLeft) does. kNotFound if not a member.
  absl::Status retire_member(int id, std::chrono::milliseconds drain);

  // A dynamic group's leave (agents/core/dynamic_group.cc), in two steps. After
  // begin_leave(), a connection a peer closes is no loss: the members close theirs as
  // they retire this worker. After refuse_requests() (every member was told, so no
  // member calls any more), new requests get kUnavailable saying this worker is
  // leaving; those already taken are served.
  void begin_leave() { leaving_.store(true); }
  void refuse_requests();

  // Where the store has leases (Store::has_leases), every agent keeps a record under its
  // own lease from start() on, at record_key(its id) ("<store_prefix>alive/<id>"), and
  // watches the records of its members from when they become members until they leave
  // (agents/core/departures.h): one that vanishes (its worker died) makes that worker
  // lost, as a failed connection does, within the store's lease TTL.
  std::string record_key(int id) const;

  // Serves kControl requests (a membership protocol), on the pool like requests.
  // Without one, a kControl request gets an error reply.
  void set_control_handler(RequestHandler handler);
  // Replaces join() (a dynamic group leaves instead of waiting for everyone).
  void set_join(std::function<absl::Status(std::chrono::milliseconds)> join);

  // Sends a ping to every member (itself too) and waits for all the replies, opening
  // every connection. Pings are answered by the agent, never by user code.
  absl::Status ping_all(std::chrono::milliseconds timeout);

  // The device channel tensors to `peer` take: the first of the options' channels that
  // reaches it, else staging through host memory.
  DeviceChannel& channel_for(const PeerAddress& peer) { return channels_.for_peer(peer); }

  // RpcAgent.
  Future<Message> send(int to, Message message,
                       std::optional<std::chrono::milliseconds> timeout = std::nullopt) override;
  // The worker's entry in the membership, for send(const Destination&) to use as is.
  absl::StatusOr<Destination> resolve(std::string_view name) const override;
  Future<Message> send(const Destination& to, Message message,
                       std::optional<std::chrono::milliseconds> timeout = std::nullopt) override;
  const WorkerInfo& self() const override { return self_; }
  absl::StatusOr<WorkerInfo> worker_info(std::string_view name) const override;
  absl::StatusOr<WorkerInfo> worker_info(int id) const override;
  std::vector<WorkerInfo> worker_infos() const override;
  std::chrono::milliseconds default_timeout() const override { return options_.rpc_timeout; }
  absl::Status join(std::chrono::milliseconds timeout) override;
  absl::Status sync(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void add_membership_listener(MembershipListener listener) override;
  // Every half heartbeat (AgentOptions::heartbeat; off when zero), pings each watched
  // peer that sent nothing meanwhile; one that does not answer within half a heartbeat
  // is lost, so a stopped peer is found within about one heartbeat.
  void watch(int peer, bool watched) override;
  std::map<std::string, std::string> debug_info() const override;
  // What this agent did so far (stats/stats.h); any thread.
  StatsSnapshot stats() const { return stats_->snapshot(); }

  // TransportEvents.
  void on_accepted(const std::shared_ptr<Connection>& connection) override;
  absl::Status on_header(Connection& connection, uint64_t metadata_bytes,
                         std::span<const uint64_t> tensor_bytes) override;
  void on_message(const std::shared_ptr<Connection>& connection, Wire wire) override;
  void on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) override;
  void on_descriptor(const std::shared_ptr<Connection>& connection, uint64_t tag, int fd, std::string note) override;
  // Gives the device channels the core's services (internal::Channels::Core).
  void attach_channels();

 private:
  Agent(WorkerInfo self, std::shared_ptr<Store> store, AgentOptions options, std::unique_ptr<Transport> transport);
  // Makes the stack over the pool and the call table (start(), once owned).
  void build(RequestHandler handler);

  // Runs the handshake's step for a message on a connection not open yet.
  void handshake(const std::shared_ptr<Connection>& connection, const Wire& wire);
  // Why a call made now cannot go, if it cannot: shut down, or made by an inline function.
  std::optional<absl::Status> refuse_call() const;
  absl::Status check_claim(int id, const std::string& name) const;
  // What every object below reports: `peer` is lost (or, after join, left).
  void on_peer_lost(int peer, absl::Status why);
  void notify(WorkerInfo worker, MembershipChange change);
  void deliver_changes();
  // Watches the records of `workers` other than this one (record_key).
  void watch_records(const std::vector<WorkerInfo>& workers);

  const WorkerInfo self_;
  const std::shared_ptr<Store> store_;
  const AgentOptions options_;
  std::unique_ptr<Transport> transport_;
  std::string address_;

  const std::shared_ptr<internal::Activity> activity_;
  // Before calls_: the call table's last completions record here.
  const std::unique_ptr<AgentStats> stats_ = std::make_unique<AgentStats>(self_.name);
  std::unique_ptr<internal::PublishedMetrics> metrics_;  // serves stats_; null without an endpoint
  const std::unique_ptr<TraceRecorder> trace_ = TraceRecorder::from_env(self_.name, self_.id);  // null: FERRY_TRACE unset
  std::shared_ptr<internal::ThreadPool> pool_;
  std::unique_ptr<internal::CallTable> calls_;
  internal::Membership members_;
  internal::Channels channels_;
  const internal::Handshake handshake_;
  // The stack, bottom up; destroyed top down, before what it stands on.
  std::unique_ptr<internal::JoinBarrier> barrier_;
  std::unique_ptr<internal::Links> links_;
  std::unique_ptr<internal::Outbox> outbox_;
  std::unique_ptr<internal::Server> server_;
  std::unique_ptr<internal::Liveness> liveness_;
  std::unique_ptr<internal::DepartureWatch> departures_;  // null: the store has no leases

  std::atomic<bool> dynamic_{false};
  std::atomic<int> group_size_{0};
  std::atomic<bool> leaving_{false};
  std::atomic<bool> shut_down_{false};

  internal::RankedMutex hooks_mu_{internal::LockRank::kHooks};
  std::shared_ptr<const std::function<absl::Status(std::chrono::milliseconds)>> join_ ABSL_GUARDED_BY(hooks_mu_);
  // Held while listeners run: one change at a time.
  internal::RankedMutex listeners_mu_{internal::LockRank::kListeners};
  std::vector<MembershipListener> listeners_ ABSL_GUARDED_BY(listeners_mu_);
  // Changes wait here so that listeners hear them in the order they happened, though
  // the pool has many threads: one pool task at a time delivers them.
  internal::RankedMutex changes_mu_{internal::LockRank::kChanges};
  std::deque<std::pair<WorkerInfo, MembershipChange>> changes_ ABSL_GUARDED_BY(changes_mu_);
  bool delivering_ ABSL_GUARDED_BY(changes_mu_) = false;
};

}  // namespace ferry
