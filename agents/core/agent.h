// File: agents/core/agent.h
//
// Agent: the one RpcAgent of ferry, over any Transport (agents/core/transport.h). A
// transport adapter (agents/tensorpipe/, agents/process_group/, agents/inproc/) only
// moves bytes; the agent owns every protocol above it:
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
// Threads: transport events arrive on transport threads and never block; user code
// (request handlers, future callbacks, membership listeners) runs on the pool; one
// timer thread fails calls at their deadline and ends handshakes that ran too long.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "agents/core/device_channel.h"
#include "agents/core/membership.h"
#include "agents/core/transport.h"
#include "agents/rpc_agent.h"
#include "base/shared_slot.h"
#include "device_maps/device_map.h"
#include "metrics/metrics_server.h"
#include "stats/stats.h"
#include "trace/trace.h"
#include "store/store.h"

namespace ferry {

namespace internal {
class Activity;
class CallTable;
class PublishedMetrics;
class ThreadPool;
}  // namespace internal

struct AgentOptions {
  // Threads running incoming requests, continuations and listeners; at least 1.
  int num_worker_threads = 16;
  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  // Where this worker's CUDA tensors land on each peer, and the maps replies travel
  // back on.
  DeviceMaps device_maps;
  DeviceMaps reverse_device_maps;
  // The CUDA devices this agent handles; empty: those its maps name (the local side of
  // device_maps and of reverse_device_maps).
  std::vector<Device> devices;
  // A peer with calls pending that sends nothing for this long is pinged; one that does
  // not answer the ping within it too is lost (its calls fail with kUnavailable, even
  // those with no timeout). Zero: off.
  std::chrono::milliseconds heartbeat{std::chrono::seconds(5)};
  // Store keys of this agent's join() rounds start with this.
  std::string store_prefix = "ferry/rpc/";
  // Requests served on the transport thread that received them (see InlineFilter);
  // unset: every request goes to the pool.
  InlineFilter serves_inline;
  // The job token (docs/security.md; "" for none; see base/auth.h's job_token() for the
  // FERRY_AUTH_TOKEN default). With one, every connection starts with a
  // challenge-response in which the opener proves the token and the worker name and id
  // it claims; a connection without the token, with another one, or claiming a name or
  // id the membership gives someone else is refused: its calls fail with
  // kUnauthenticated, and the refusing worker logs why. A second connection that
  // proves an id which already has one here replaces it (the older is closed: a
  // restarted worker). All workers of a group must agree.
  std::string auth_token;
  // With a token: how long a peer's connection may stay unauthenticated before it is
  // closed, and how long a connection this worker opens may wait for the peer's
  // challenge before the peer is lost (its calls fail with kUnavailable naming it).
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(5)};
  // Requests (kRequest) in flight between one caller and this worker: a caller writes
  // at most this many to a peer before replies come back, holding the rest (its
  // memory, not the server's); a server serving this many from one connection stops
  // reading it until one is answered (Connection::pause_reads), so a caller with a
  // larger setting, or one that is not ferry, waits in its own transport. Pings and
  // control requests are not counted, but wait unread behind a pause; the server then
  // sends kBusy every quarter heartbeat so that the caller's heartbeat still hears it.
  // A request a transport delivers past a pause is answered kResourceExhausted, unrun.
  // At least 1.
  int max_requests_in_flight = 1024;
  // Device channels tried before staging, in order (Agent::channel_for).
  std::vector<std::shared_ptr<DeviceChannel>> device_channels;
  // The metrics endpoint's port (docs/observability.md; 0: any free one); unset:
  // FERRY_METRICS_PORT decides, and without it there is no endpoint.
  std::optional<int> metrics_port;
};

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
  void begin_leave();
  void refuse_requests();

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
  DeviceChannel& channel_for(const PeerAddress& peer);

  // RpcAgent.
  Future<Message> send(int to, Message message,
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

  // What the statistics and the trace keep of a request until its reply goes.
  struct Served {
    AgentStats::Request observed;
    AgentStats::Clock::time_point started;  // its handler's start (traced only)
    std::string function;                   // traced only
  };
  // The request a pool thread is serving, for defer_reply() (agents/rpc_agent.h).
  struct ServingRequest {
    std::shared_ptr<Connection> from;
    std::shared_ptr<const internal::Membership::Table> table;  // keeps `member` alive
    const internal::Member* member;
    WorkerInfo caller;
    uint64_t id;
    bool counted;
    Served served;
    bool deferred = false;
    Agent* agent = nullptr;
  };
  // Makes `request` the one defer_reply() on this thread defers, while it lives.
  class ServingScope {
   public:
    ServingScope(Agent* agent, ServingRequest* request);
    ~ServingScope();
    ServingScope(const ServingScope&) = delete;
    ServingScope& operator=(const ServingScope&) = delete;

   private:
    ServingRequest* previous_;
  };
  DeferredReply defer(ServingRequest& request, std::optional<std::chrono::milliseconds> timeout);

  // TransportEvents.
  void on_accepted(const std::shared_ptr<Connection>& connection) override;
  absl::Status on_header(Connection& connection, uint64_t metadata_bytes,
                         std::span<const uint64_t> tensor_bytes) override;
  void on_message(const std::shared_ptr<Connection>& connection, Wire wire) override;
  void on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) override;

 private:
  Agent(WorkerInfo self, std::shared_ptr<Store> store, AgentOptions options, RequestHandler handler,
        std::unique_ptr<Transport> transport);

  // join()'s barrier: claims the fate of worker `id` ("arrived" for itself, else
  // "lost") under `prefix`, once per worker; the claim that accounts for the last
  // worker sets "<prefix>done".
  // Returns the order of this worker's arrival (1: first) for its own claim, else 0.
  absl::StatusOr<int64_t> account(const std::string& prefix, int id, bool arrived, int n);
  // Waits until every worker is accounted for, accounting the losses this worker sees.
  absl::Status wait_in_barrier(const std::string& prefix, int n, std::chrono::steady_clock::time_point deadline);
  // Whether a connection this worker opened to `peer` is up.
  bool linked_to(int peer) const;

  // Sending: the connection to `peer`, opened (and its handshake begun) on first use.
  // `counted`: the call id of a kRequest, which waits for room under
  // max_requests_in_flight.
  void write_request(const PeerAddress& peer, Wire wire, std::optional<uint64_t> counted);
  // A connection `peer` opened to us that may carry our calls to it too
  // (Connection::carries_calls_to), marked shared; null when there is none to share.
  // Called under links_mu_.
  std::shared_ptr<Connection> share_incoming(const PeerAddress& peer);
  // An accepted connection may be shared from now on (its opener knows it is accepted).
  void allow_sharing(Connection& connection);
  // Takes `peer`'s link out of the table if it rides `connection`; whether it did.
  bool forget_link(int peer, const Connection* connection);
  // A connection carrying our calls to its peer ended: the peer is lost.
  void link_lost(const internal::Session& s, absl::Status why);
  // A reply to one of our calls came on `connection`: its room goes to the next held
  // request, and the call completes.
  void take_reply(const std::shared_ptr<Connection>& connection, Wire wire);
  // Writes `wire` on an open link unless max_requests_in_flight are out; then it is held.
  void write_counted(const std::shared_ptr<Connection>& connection, Wire wire, uint64_t id);
  // A reply to request `id` came on `connection`'s link: its room goes to the next held.
  void answered(const std::shared_ptr<Connection>& connection, uint64_t id);
  // Serving: a connection a peer opened stops being read while it has
  // max_requests_in_flight requests here (pause_reads from its on_message), and is
  // read again when one is answered (resume_reads, from the thread that answered).
  void pause_reads(const std::shared_ptr<Connection>& connection);
  void resume_reads(Connection& connection);
  // While `connection` is paused, a kBusy every quarter heartbeat tells its caller's
  // heartbeat that this worker is alive: the caller's pings wait unread behind the pause.
  void keep_alive(const std::shared_ptr<Connection>& connection);
  // Connects the link whose first send this was, writes the hello, and (without a
  // token) lets the waiting requests follow.
  void open_link(const PeerAddress& peer, std::shared_ptr<internal::Session> session);
  // With a token: a link whose acceptor sent no challenge within handshake_timeout is
  // dropped and its peer lost.
  void expect_challenge(const PeerAddress& peer, const std::shared_ptr<internal::Session>& session);
  void flush(const std::shared_ptr<Connection>& connection);
  // Takes `peer`'s link out of the table and closes its connection. `left`: the peer
  // left the group, and a connection that carries its own calls too stays open for it
  // to close once they are done.
  void drop_connection(int peer, bool left = false);
  // Handshake steps (agents/core/handshake.h).
  void on_hello(const std::shared_ptr<Connection>& connection, const Wire& wire);
  void on_proof(const std::shared_ptr<Connection>& connection, const Wire& wire);
  void on_challenge(const std::shared_ptr<Connection>& connection, const Wire& wire);
  void on_verdict(const std::shared_ptr<Connection>& connection, const Wire& wire);
  void refuse(const std::shared_ptr<Connection>& connection, std::string_view why, std::string_view tell);
  // Ends a connection of ours whose handshake failed: its peer's calls fail with `why`.
  void fail_link(const std::shared_ptr<Connection>& connection, absl::Status why);
  void authenticated(Connection& connection);
  absl::Status check_claim(int id, const std::string& name) const;

  void on_request(const std::shared_ptr<Connection>& from, Wire wire);
  void on_reply(int peer, Wire wire);
  void on_peer_lost(int peer, absl::Status why);
  // Closes the authenticated pipe `peer` opened to this worker, if any.
  void close_incoming(int peer);
  // `arrived`: when the request was read, to drop it unrun once its caller's timeout
  // has passed; `observed`: its statistics so far.
  void serve(const std::shared_ptr<Connection>& from, std::vector<std::string> targets, Message request,
             std::chrono::steady_clock::time_point arrived, AgentStats::Request observed = {});
  // The tail of serve(): stages the reply's tensors back through the caller's channel
  // and writes it on `from`. `member` (null for a caller not in the table) must outlive
  // the call.
  // `counted`: a kRequest, counted in its connection's serving until now.
  void send_reply(const std::shared_ptr<Connection>& from, const internal::Member* member, const WorkerInfo& caller,
                  uint64_t id, bool counted, const Served& served, Message reply);
  void forget_lost(int id);
  // Pings `peer`; one that does not answer within `wait` (and sent nothing since) is lost.
  void suspect(int peer, std::chrono::milliseconds wait);
  // The watch's timer task: suspects every watched peer, and comes back while any is.
  void check_watched();
  void complete_reply(int peer, std::vector<std::string> targets, Message reply);
  void notify(WorkerInfo worker, MembershipChange change);
  void deliver_changes();
  absl::Status land(std::vector<Tensor>& tensors, const std::vector<std::string>& targets);
  std::shared_ptr<const DeviceMaps> device_maps() const { return device_maps_.load(); }
  std::shared_ptr<const DeviceMaps> reverse_device_maps() const { return reverse_device_maps_.load(); }

  const WorkerInfo self_;
  const std::shared_ptr<Store> store_;
  const AgentOptions options_;
  const RequestHandler handler_;
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
  std::shared_ptr<DeviceChannel> staging_;
  SharedSlot<const DeviceMaps> device_maps_;
  SharedSlot<const DeviceMaps> reverse_device_maps_;
  std::atomic<bool> dynamic_{false};
  std::atomic<int> group_size_{0};
  // Lost members of a static group, kept in the table: id -> why.
  mutable std::mutex lost_mu_;
  absl::flat_hash_map<int, absl::Status> lost_;  // guarded by lost_mu_
  std::atomic<bool> any_lost_{false};
  // Between arriving in join() and everyone being accounted for, losses are told once
  // it is known whether the peer left (it arrived too) or was lost.
  std::atomic<bool> in_barrier_{false};
  std::vector<WorkerInfo> deferred_;  // guarded by lost_mu_
  std::string barrier_prefix_;        // guarded by lost_mu_: the barrier's store keys
  int barrier_size_ = 0;              // guarded by lost_mu_
  std::mutex watch_mu_;
  absl::flat_hash_set<int> watched_;  // guarded by watch_mu_
  bool watching_ = false;             // guarded by watch_mu_: check_watched() is scheduled
  std::mutex pinging_mu_;
  absl::flat_hash_set<int> pinging_;  // guarded by pinging_mu_: peers with a heartbeat ping out

  // The connections this worker's calls go on, by peer id: one it opened, or one the
  // peer opened that carries our calls too (share_incoming). A link's session exists
  // from the first send on; its connection is null while connect() runs (outside the
  // lock), and the sends meanwhile wait in the session, so one peer never gets two
  // connections from us. Lock order: links_mu_, then accepted_mu_, then a session's
  // flow_mu.
  struct Link {
    std::shared_ptr<internal::Session> session;
    std::shared_ptr<Connection> connection;
  };
  mutable std::mutex links_mu_;
  absl::flat_hash_map<int, Link> links_;  // guarded by links_mu_
  // Connections peers opened: those still authenticating, and the authenticated ones
  // by the id they proved (one per id).
  mutable std::mutex accepted_mu_;
  absl::flat_hash_set<Connection*> unauthenticated_;                 // guarded by accepted_mu_
  absl::flat_hash_map<int, std::weak_ptr<Connection>> authenticated_;  // guarded by accepted_mu_
  std::atomic<uint64_t> handshakes_refused_{0};
  std::atomic<uint64_t> links_shared_{0};  // links made on a peer's connection, ever

  std::mutex hooks_mu_;
  std::shared_ptr<const RequestHandler> control_handler_;                               // guarded by hooks_mu_
  std::shared_ptr<const std::function<absl::Status(std::chrono::milliseconds)>> join_;  // guarded by hooks_mu_

  std::mutex listeners_mu_;  // held while listeners run: one change at a time
  std::vector<MembershipListener> listeners_;
  // Changes wait here so that listeners hear them in the order they happened,
  // though the pool has many threads: one pool task at a time delivers them.
  std::mutex changes_mu_;
  std::deque<std::pair<WorkerInfo, MembershipChange>> changes_;  // guarded by changes_mu_
  bool delivering_ = false;                                       // guarded by changes_mu_

  // 0: a member; 1: leaving (begin_leave); 2: refusing requests (refuse_requests).
  std::atomic<int> leaving_{0};
  // join() saw every worker arrive: a peer that goes from now on left; it was not lost.
  std::atomic<bool> departing_{false};
  std::atomic<uint64_t> requests_served_{0};
  // Backpressure (debug_info): pauses of a connection's reads at the cap, requests
  // refused at the cap (a transport delivered past a pause), the most requests one
  // connection had here at once.
  std::atomic<uint64_t> reads_paused_{0};
  std::atomic<uint64_t> requests_refused_{0};
  std::atomic<int> serving_peak_{0};
  std::atomic<bool> shut_down_{false};
  std::atomic<int> join_generation_{0};
};

}  // namespace ferry
