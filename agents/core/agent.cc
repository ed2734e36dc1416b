#include "agents/core/agent.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/core/activity.h"
#include "agents/core/call_table.h"
#include "agents/core/cuda_staging.h"
#include "agents/core/handshake.h"
#include "agents/core/observe.h"
#include "agents/core/session.h"
#include "agents/core/thread_pool.h"
#include "base/auth.h"
#include "base/logging.h"
#include "base/status.h"
#include "serialization/archive.h"
#include "serialization/error.h"

namespace ferry {

using internal::AuthKind;
using internal::InlineServingScope;
using internal::on_agent_thread;
using internal::run_callback_guarded;
using internal::run_on_reaper;
using internal::serving_inline;
using internal::CallTable;
using internal::Member;
using internal::Membership;
using internal::Session;
using internal::Stage;

namespace {

using Clock = std::chrono::steady_clock;

// How long shutdown waits for user functions still running on the pool; a function
// that never returns must not hang the process's exit.
constexpr std::chrono::seconds kPoolShutdownDeadline{60};

const DeviceMap* map_towards(const DeviceMaps& maps, const std::string& peer) {
  auto it = maps.find(peer);
  return it == maps.end() ? nullptr : &it->second;
}

// The local devices a worker's maps name, when it listed none itself.
std::vector<Device> devices_of(const DeviceMaps& maps, const DeviceMaps& reverse) {
  std::vector<Device> out;
  auto add = [&](Device d) {
    if (!d.is_cpu() && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& [peer, map] : maps) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  // A reverse map is keyed by this worker's devices too: {mine -> the caller's}.
  for (const auto& [peer, map] : reverse) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  return out;
}

// join(): when the first worker to arrive first probes the workers that have not.
constexpr std::chrono::milliseconds kFirstProbe{300};

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

std::string describe(const Session& s) {
  return s.peer_name.empty() ? std::string("an unnamed peer") : absl::StrCat("\"", s.peer_name, "\"");
}

// Whether a sealed message on a connection that carries calls both ways is a request
// (served here) rather than a reply (to a call of ours), read from its header's type
// byte without parsing it. One too short to tell is a request: on_request refuses it.
bool is_request(const std::string& metadata) {
  if (metadata.size() < Message::kHeaderSize) return true;
  const auto type = static_cast<MessageType>(metadata[3]);
  return type != MessageType::kResponse && type != MessageType::kError && type != MessageType::kBusy;
}

}  // namespace

Agent::Agent(WorkerInfo self, std::shared_ptr<Store> store, AgentOptions options, RequestHandler handler,
             std::unique_ptr<Transport> transport)
    : self_(std::move(self)),
      store_(std::move(store)),
      options_(std::move(options)),
      handler_(std::move(handler)),
      transport_(std::move(transport)),
      activity_(std::make_shared<internal::Activity>()),
      device_maps_(std::make_shared<const DeviceMaps>(options_.device_maps)),
      reverse_device_maps_(std::make_shared<const DeviceMaps>(options_.reverse_device_maps)) {
  staging_ = std::make_shared<internal::CudaStaging>(
      options_.devices.empty() ? devices_of(options_.device_maps, options_.reverse_device_maps) : options_.devices);
}

absl::StatusOr<std::shared_ptr<Agent>> Agent::start(WorkerInfo self, std::shared_ptr<Store> store,
                                                    AgentOptions options, RequestHandler handler,
                                                    std::unique_ptr<Transport> transport) {
  if (self.name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (self.id < 0) return absl::InvalidArgumentError(absl::StrCat("rank must be >= 0, got ", self.id));
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  if (transport == nullptr) return absl::InvalidArgumentError("transport is null");
  if (options.max_requests_in_flight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_requests_in_flight must be at least 1, got ", options.max_requests_in_flight));
  }
  if (options.num_worker_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_worker_threads must be at least 1, got ", options.num_worker_threads));
  }
  if (options.handshake_timeout.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("handshake_timeout must be > 0 ms, got ",
                                                   options.handshake_timeout.count(), " ms"));
  }
  std::shared_ptr<Agent> agent(
      new Agent(std::move(self), std::move(store), std::move(options), std::move(handler), std::move(transport)));
  agent->pool_ = std::make_shared<internal::ThreadPool>(agent->options_.num_worker_threads, agent->activity_);
  agent->calls_ = std::make_unique<CallTable>(agent->pool_, agent->activity_);
  if (agent->options_.heartbeat.count() > 0) {
    std::weak_ptr<Agent> weak = agent;
    agent->calls_->set_heartbeat(agent->options_.heartbeat, [weak](int peer) {
      if (std::shared_ptr<Agent> a = weak.lock()) a->suspect(peer, a->options_.heartbeat);
    });
  }
  absl::StatusOr<std::string> address = agent->transport_->listen(agent);
  if (!address.ok()) {
    agent->shutdown();
    return address.status();
  }
  agent->address_ = *std::move(address);
  absl::StatusOr<std::unique_ptr<internal::PublishedMetrics>> metrics = internal::serve_metrics(
      agent->options_.metrics_port, agent->self_.name, *agent->store_, kMetricsStorePrefix, *agent->stats_);
  if (!metrics.ok()) {
    agent->shutdown();
    return metrics.status();
  }
  agent->metrics_ = *std::move(metrics);
  return agent;
}

Agent::~Agent() {
  if (shut_down_.exchange(true)) return;
  if (!on_agent_thread()) {
    shut_down_.store(false);
    shutdown();
    return;
  }
  // The last reference went on one of our own threads (a callback dropped it): that
  // thread cannot join itself, so a thread of its own tears down what is left. The
  // transport reaches us only through a weak reference, which no longer locks.
  struct Remains {
    std::unique_ptr<Transport> transport;
    std::unique_ptr<CallTable> calls;
    std::shared_ptr<internal::ThreadPool> pool;
    std::shared_ptr<internal::Activity> activity;
  };
  auto remains = std::make_shared<Remains>(
      Remains{std::move(transport_), std::move(calls_), std::move(pool_), activity_});
  run_on_reaper([remains] {
    if (remains->transport) remains->transport->close();
    if (remains->calls) {
      remains->calls->fail_all(absl::CancelledError("the agent was destroyed"));
      remains->calls->stop();
    }
    if (remains->pool) remains->pool->shutdown(kPoolShutdownDeadline);
  });
}

uint64_t Agent::membership_version() const { return members_.snapshot()->version; }

absl::Status Agent::set_members(std::vector<PeerAddress> members) {
  int n = static_cast<int>(members.size());
  FERRY_RETURN_IF_ERROR(members_.add(std::move(members)));
  group_size_.store(n);
  return absl::OkStatus();
}

void Agent::forget_lost(int id) {
  std::lock_guard<std::mutex> lock(lost_mu_);
  lost_.erase(id);
}

absl::Status Agent::add_member(PeerAddress member) {
  WorkerInfo info = member.info;
  FERRY_RETURN_IF_ERROR(members_.add(std::move(member)));
  forget_lost(info.id);
  group_size_.fetch_add(1);
  notify(std::move(info), MembershipChange::kJoined);
  return absl::OkStatus();
}

absl::Status Agent::remove_member(int id, MembershipChange why) {
  FERRY_ASSIGN_OR_RETURN(Member gone, members_.remove(id, why));
  group_size_.fetch_sub(1);
  absl::Status status = why == MembershipChange::kLeft
                            ? absl::UnavailableError(absl::StrCat("worker \"", gone.info.name, "\" (id ", id,
                                                                  ") left the group"))
                            : absl::UnavailableError(absl::StrCat("worker \"", gone.info.name, "\" (id ", id,
                                                                  ") was lost"));
  calls_->fail_peer(id, status);
  drop_connection(id, /*left=*/why == MembershipChange::kLeft);
  // A leaver closes its own pipes once its calls are done; a lost one never will.
  if (why == MembershipChange::kLost) close_incoming(id);
  forget_lost(id);
  notify(gone.info, why);
  return absl::OkStatus();
}

absl::Status Agent::retire_member(int id, std::chrono::milliseconds drain) {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* m = table->find(id);
  if (m == nullptr) return table->absent(id);
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    lost_[id] = absl::UnavailableError(absl::StrCat("worker \"", m->info.name, "\" (id ", id, ") left the group"));
    any_lost_.store(true, std::memory_order_release);
  }
  if (!calls_->wait_peer_idle(id, drain)) {
    FERRY_LOG(WARNING) << self_.name << ": calls to " << m->info.name << " still pending after " << drain.count()
                       << " ms; failing them as it leaves";
  }
  return remove_member(id, MembershipChange::kLeft);
}

void Agent::begin_leave() {
  int member = 0;
  leaving_.compare_exchange_strong(member, 1);
}

void Agent::refuse_requests() { leaving_.store(2); }

bool Agent::linked_to(int peer) const {
  std::lock_guard<std::mutex> lock(links_mu_);
  auto it = links_.find(peer);
  return it != links_.end() && !it->second.session->closed.load(std::memory_order_acquire);
}

void Agent::set_control_handler(RequestHandler handler) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  control_handler_ = std::make_shared<const RequestHandler>(std::move(handler));
}

void Agent::set_join(std::function<absl::Status(std::chrono::milliseconds)> join) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  join_ = std::make_shared<const std::function<absl::Status(std::chrono::milliseconds)>>(std::move(join));
}

void Agent::set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices) {
  std::vector<Device> handled = devices.empty() ? devices_of(device_maps, reverse_device_maps) : std::move(devices);
  for (const std::shared_ptr<DeviceChannel>& channel : options_.device_channels) channel->set_devices(handled);
  staging_->set_devices(std::move(handled));
  device_maps_.store(std::make_shared<const DeviceMaps>(std::move(device_maps)));
  reverse_device_maps_.store(std::make_shared<const DeviceMaps>(std::move(reverse_device_maps)));
}

DeviceChannel& Agent::channel_for(const PeerAddress& peer) {
  for (const std::shared_ptr<DeviceChannel>& channel : options_.device_channels) {
    if (channel->reaches(peer.address)) return *channel;
  }
  return *staging_;
}

absl::Status Agent::land(std::vector<Tensor>& tensors, const std::vector<std::string>& targets) {
  for (const std::shared_ptr<DeviceChannel>& channel : options_.device_channels) {
    FERRY_RETURN_IF_ERROR(channel->land_incoming(tensors, targets));
  }
  return staging_->land_incoming(tensors, targets);
}

absl::Status Agent::ping_all(std::chrono::milliseconds timeout) {
  std::vector<Future<Message>> replies;
  for (const WorkerInfo& w : worker_infos()) replies.push_back(send(w.id, Message(MessageType::kPing, 0), timeout));
  for (const Future<Message>& reply : replies) FERRY_RETURN_IF_ERROR(reply.status());
  return absl::OkStatus();
}

Future<Message> Agent::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  if (shut_down_.load(std::memory_order_relaxed)) {
    return make_ready_future<Message>(absl::CancelledError("the agent shut down"));
  }
  if (serving_inline()) {
    return make_ready_future<Message>(absl::FailedPreconditionError(absl::StrCat(
        self_.name, ": a function served inline made a call; inline functions run on the transport thread, "
                    "which must deliver that call's reply, so they must not make calls or block "
                    "(register the function to run on the worker pool instead)")));
  }
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* peer = table->find(to);
  if (peer == nullptr) {
    return make_ready_future<Message>(table->absent(to));
  }
  if (any_lost_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    auto it = lost_.find(to);
    if (it != lost_.end()) return make_ready_future<Message>(it->second);
  }
  // Device tensors are prepared before the call is registered: a tensor the map cannot
  // place fails here, and nothing is sent.
  Wire wire;
  wire.tensors = std::move(message.tensors());
  if (!wire.tensors.empty()) {
    std::shared_ptr<const DeviceMaps> maps = device_maps();
    absl::Status staged = channel_for(*peer).stage_outgoing(wire.tensors, wire.targets,
                                                            map_towards(*maps, peer->info.name), peer->info.name);
    if (!staged.ok()) return make_ready_future<Message>(std::move(staged));
  }
  const std::chrono::milliseconds limit = timeout.value_or(options_.rpc_timeout);
  CallTable::Started call =
      calls_->start(to, peer->info.name, limit,
                    stats_->call_started(peer->info.name, internal::call_name(message),
                                         internal::wire_bytes(message.buffer().size(), wire.tensors)));
  message.set_id(call.id);
  // The server drops a request whose caller gave up before it ran.
  message.set_timeout(limit);
  const bool counted = message.type() == MessageType::kRequest;
  if (trace_) internal::observe_trace(call.future, *trace_, *peer, internal::call_name(message), call.id);
  wire.metadata = message.seal();
  write_request(*peer, std::move(wire), counted ? std::optional<uint64_t>(call.id) : std::nullopt);
  // Lost (or shut down) while this call was being registered: on_peer_lost may have
  // swept the table before the call was in it.
  if (any_lost_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    auto it = lost_.find(to);
    if (it != lost_.end()) calls_->complete(call.id, it->second);
  }
  if (shut_down_.load(std::memory_order_acquire)) calls_->complete(call.id, absl::CancelledError("the agent shut down"));
  return std::move(call.future);
}

void Agent::write_request(const PeerAddress& peer, Wire wire, std::optional<uint64_t> counted) {
  Link link;
  bool opens = false;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    auto [it, inserted] = links_.try_emplace(peer.info.id);
    if (inserted) {
      if (std::shared_ptr<Connection> theirs = share_incoming(peer)) {
        // The peer's connection to us carries our calls to it too: no second one.
        it->second.session = std::shared_ptr<Session>(theirs, theirs->session());
        it->second.connection = std::move(theirs);
      } else {
        // Every connection opens with a hello saying who we are; with a token it starts
        // the challenge-response, without one requests follow it at once.
        const bool token = !options_.auth_token.empty();
        it->second.session =
            std::make_shared<Session>(true, peer.info.id, peer.info.name, token ? Stage::kHello : Stage::kOpen);
        if (token) it->second.session->nonce_c = internal::auth::nonce();
        opens = true;
      }
    }
    link = it->second;
  }
  Session& s = *link.session;
  if (!s.open.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.open.load(std::memory_order_relaxed)) {
      s.pending.push_back(internal::Outgoing{std::move(wire), counted.value_or(0)});
      if (!opens) return;
    }
  }
  if (opens) {
    open_link(peer, std::move(link.session));
    return;
  }
  if (link.connection == nullptr) {
    // Opened since we looked: the connection is in the table now.
    std::lock_guard<std::mutex> lock(links_mu_);
    auto it = links_.find(peer.info.id);
    if (it == links_.end() || it->second.session != link.session) return;  // dropped meanwhile
    link.connection = it->second.connection;
  }
  if (counted) {
    write_counted(link.connection, std::move(wire), *counted);
  } else {
    link.connection->write(std::move(wire));
  }
}

std::shared_ptr<Connection> Agent::share_incoming(const PeerAddress& peer) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    auto it = authenticated_.find(peer.info.id);
    if (it == authenticated_.end()) return nullptr;
    connection = it->second.lock();
  }
  // Opened by the process at the member's address, not only named after it.
  if (connection == nullptr || !connection->carries_calls_to(peer.address)) return nullptr;
  Session& s = *connection->session();
  // The name too: an id the membership now gives another worker (a dynamic group)
  // must not get calls meant for this one.
  if (s.peer_name != peer.info.name) return nullptr;
  std::lock_guard<std::mutex> lock(s.flow_mu);
  // A paused connection would hold our replies back behind the peer's requests.
  if (!s.shareable || s.reads_paused.load(std::memory_order_seq_cst) || s.closed.load(std::memory_order_acquire)) {
    return nullptr;
  }
  s.shared.store(true, std::memory_order_release);
  links_shared_.fetch_add(1, std::memory_order_relaxed);
  return connection;
}

void Agent::allow_sharing(Connection& connection) {
  Session& s = *connection.session();
  std::lock_guard<std::mutex> lock(s.flow_mu);
  s.shareable = true;
}

bool Agent::forget_link(int peer, const Connection* connection) {
  std::lock_guard<std::mutex> lock(links_mu_);
  auto it = links_.find(peer);
  if (it == links_.end() || it->second.connection.get() != connection) return false;
  links_.erase(it);
  return true;
}

void Agent::write_counted(const std::shared_ptr<Connection>& connection, Wire wire, uint64_t id) {
  Session& s = *connection->session();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    // Behind those already held, in order.
    if (!s.held.empty() || s.in_flight.size() >= static_cast<size_t>(options_.max_requests_in_flight)) {
      s.held.push_back(internal::Outgoing{std::move(wire), id});
      return;
    }
    s.in_flight.insert(id);
  }
  connection->write(std::move(wire));
}

void Agent::answered(const std::shared_ptr<Connection>& connection, uint64_t id) {
  Session& s = *connection->session();
  std::vector<Wire> go;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.in_flight.erase(id) == 0) return;
    while (!s.held.empty() && s.in_flight.size() < static_cast<size_t>(options_.max_requests_in_flight)) {
      internal::Outgoing next = std::move(s.held.front());
      s.held.pop_front();
      // A call that ended while held (timed out) is not sent at all; one that goes
      // carries the time its caller has left, not the time it had when it was made.
      std::optional<Clock::time_point> deadline = calls_->deadline_of(next.counted);
      if (!deadline) continue;
      if (*deadline != Clock::time_point::max()) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now());
        Message::reseal_timeout(next.wire.metadata, std::max(left, std::chrono::milliseconds(1)));
      }
      s.in_flight.insert(next.counted);
      go.push_back(std::move(next.wire));
    }
  }
  for (Wire& w : go) connection->write(std::move(w));
}

void Agent::open_link(const PeerAddress& peer, std::shared_ptr<Session> session) {
  // The transport is called outside our locks: it may run its callbacks on this thread.
  std::shared_ptr<Connection> connection = transport_->connect(session, peer.info.name, peer.address);
  bool current;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    auto it = links_.find(peer.info.id);
    current = it != links_.end() && it->second.session == session;
    if (current) it->second.connection = connection;
  }
  if (!current) {
    // Dropped while connecting (the peer was removed or lost): its calls failed already.
    connection->close();
    return;
  }
  connection->write(internal::auth_message(AuthKind::kHello, {self_.name, std::to_string(self_.id), session->nonce_c}));
  if (session->stage == Stage::kOpen) {
    flush(connection);
  } else {
    expect_challenge(peer, session);
  }
  if (session->closed.load(std::memory_order_acquire)) {
    // It ended before it was in the table (a peer we share no transport with).
    absl::Status why;
    {
      std::lock_guard<std::mutex> lock(session->mu);
      why = session->closed_why;
    }
    on_closed(connection, std::move(why));
  }
}

void Agent::expect_challenge(const PeerAddress& peer, const std::shared_ptr<Session>& session) {
  // An acceptor that never answers (stopped, or not a ferry worker) would otherwise hold
  // the requests queued behind the handshake forever, those without a timeout too
  // (issue 27, finding 8). `open` turns on when its challenge came and our requests
  // went; what happens after that is the heartbeat's to judge.
  std::weak_ptr<Agent> weak = weak_from_this();
  std::weak_ptr<Session> weak_session = session;
  const std::chrono::milliseconds limit = options_.handshake_timeout;
  calls_->run_at(Clock::now() + limit, [weak, weak_session, id = peer.info.id, name = peer.info.name, limit] {
    std::shared_ptr<Agent> agent = weak.lock();
    std::shared_ptr<Session> s = weak_session.lock();
    if (!agent || !s || s->open.load(std::memory_order_acquire)) return;
    std::shared_ptr<Connection> connection;
    {
      std::lock_guard<std::mutex> lock(agent->links_mu_);
      auto it = agent->links_.find(id);
      if (it == agent->links_.end() || it->second.session != s) return;  // ended or replaced meanwhile
      connection = std::move(it->second.connection);
      agent->links_.erase(it);
    }
    // Out of the table first, so the close reports nothing more.
    if (connection != nullptr) connection->close();
    agent->on_peer_lost(id, absl::UnavailableError(absl::StrCat(
                                "worker \"", name, "\" (id ", id, ") did not answer this worker's job-token hello within ",
                                limit.count(), " ms (handshake_timeout); is it stopped, or not a ferry worker?")));
  });
}

void Agent::flush(const std::shared_ptr<Connection>& connection) {
  Session& s = *connection->session();
  for (;;) {
    std::vector<internal::Outgoing> batch;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.pending.empty()) {
        s.open.store(true, std::memory_order_release);
        return;
      }
      batch.swap(s.pending);
    }
    for (internal::Outgoing& o : batch) {
      if (o.counted != 0) {
        write_counted(connection, std::move(o.wire), o.counted);
      } else {
        connection->write(std::move(o.wire));
      }
    }
  }
}

void Agent::drop_connection(int peer, bool left) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    auto it = links_.find(peer);
    if (it == links_.end()) return;
    connection = std::move(it->second.connection);
    links_.erase(it);
  }
  if (connection == nullptr) return;  // still connecting: open_link closes it
  const Session& s = *connection->session();
  // A leaver's own calls may still be on it (the leave's last messages among them): it
  // closes the connection itself when it is done. Before, they had one of their own.
  if (left && (!s.outgoing || s.serves.load(std::memory_order_acquire))) return;
  // Out of the table, its late events report nothing (on_closed checks the table).
  connection->close();
}

// ---- The transport's events.

void Agent::on_accepted(const std::shared_ptr<Connection>& connection) {
  auto session = std::make_shared<Session>(false, -1, "", Stage::kAwaitHello);
  connection->set_session(session);
  size_t waiting;
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    unauthenticated_.insert(connection.get());
    waiting = unauthenticated_.size();
  }
  if (waiting > static_cast<size_t>(internal::kMaxUnauthenticated)) {
    FERRY_LOG(WARNING) << self_.name << ": " << waiting - 1 << " connections are already waiting for their hello; "
                       << "closing a new one";
    handshakes_refused_.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(accepted_mu_);
      unauthenticated_.erase(connection.get());
    }
    session->stage = Stage::kRefused;
    connection->close();
    return;
  }
  std::weak_ptr<Agent> weak = weak_from_this();
  std::weak_ptr<Connection> weak_connection = connection;
  const std::chrono::milliseconds limit = options_.handshake_timeout;
  calls_->run_at(Clock::now() + limit, [weak, weak_connection, limit] {
    std::shared_ptr<Agent> agent = weak.lock();
    std::shared_ptr<Connection> c = weak_connection.lock();
    if (!agent || !c || c->session()->open.load(std::memory_order_acquire)) return;
    bool waiting;
    {
      std::lock_guard<std::mutex> lock(agent->accepted_mu_);
      waiting = agent->unauthenticated_.erase(c.get()) > 0;
    }
    if (!waiting) return;
    FERRY_LOG(WARNING) << agent->self_.name << ": closing a connection from " << describe(*c->session())
                       << " that did not complete its hello within " << limit.count() << " ms";
    agent->handshakes_refused_.fetch_add(1, std::memory_order_relaxed);
    c->close();
  });
}

absl::Status Agent::on_header(Connection& connection, uint64_t metadata_bytes,
                              std::span<const uint64_t> tensor_bytes) {
  Session* s = connection.session();
  if (s == nullptr) return absl::InternalError("a connection without a session (the transport skipped on_accepted)");
  // The stage, not `open`: an outgoing session turns open only once its queued
  // requests are written, and a fast peer's reply to the first of them may already be
  // here. Events of one connection run one at a time, so the stage is current.
  if (s->stage != Stage::kOpen) {
    absl::Status small = internal::check_handshake_size(metadata_bytes, tensor_bytes);
    if (!small.ok()) {
      handshakes_refused_.fetch_add(1, std::memory_order_relaxed);
      FERRY_LOG(WARNING) << self_.name << ": closing a connection from " << describe(*s) << ": " << small.message();
      return small;
    }
    return absl::OkStatus();
  }
  return check_message_size(metadata_bytes, tensor_bytes);
}

void Agent::on_message(const std::shared_ptr<Connection>& connection, Wire wire) {
  Session& s = *connection->session();
  if (s.outgoing) {
    switch (s.stage) {
      case Stage::kHello:
        on_challenge(connection, wire);
        return;
      case Stage::kProved:
        on_verdict(connection, wire);
        return;
      case Stage::kOpen:
        if (internal::is_auth_message(wire.metadata)) {
          // A worker with a job token refuses a connection that opened without one.
          on_verdict(connection, wire);
          return;
        }
        if (is_request(wire.metadata)) {
          // The acceptor's own calls, on the connection we opened (carries_calls_to).
          if (!s.serves.load(std::memory_order_relaxed)) s.serves.store(true, std::memory_order_release);
          on_request(connection, std::move(wire));
          return;
        }
        take_reply(connection, std::move(wire));
        return;
      default:
        return;
    }
  }
  switch (s.stage) {
    case Stage::kAwaitHello:
      on_hello(connection, wire);
      return;
    case Stage::kAwaitProof:
      on_proof(connection, wire);
      return;
    case Stage::kOpen:
      if (s.shared.load(std::memory_order_acquire) && !is_request(wire.metadata)) {
        // A reply to one of our calls on the peer's connection (share_incoming).
        take_reply(connection, std::move(wire));
        return;
      }
      on_request(connection, std::move(wire));
      return;
    default:
      return;
  }
}

void Agent::take_reply(const std::shared_ptr<Connection>& connection, Wire wire) {
  // Whole header: is_request takes a message too short to tell for a request.
  uint64_t id;
  std::memcpy(&id, wire.metadata.data() + 8, sizeof(id));
  answered(connection, id);
  on_reply(connection->session()->peer, std::move(wire));
}

void Agent::on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) {
  Session* s = connection->session();
  if (s == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->closed_why = why;
  }
  bool shared;
  {
    // share_incoming reads `closed` under the same lock before it shares: either it
    // sees the end, or this sees the connection shared (and its link, inserted under
    // links_mu_ with it, once forget_link takes that lock).
    std::lock_guard<std::mutex> lock(s->flow_mu);
    s->closed.store(true, std::memory_order_release);
    shared = s->shared.load(std::memory_order_acquire);
  }
  if (s->outgoing) {
    // A connection already replaced or dropped reports nothing.
    if (!forget_link(s->peer, connection.get())) return;
    link_lost(*s, std::move(why));
    return;
  }
  bool current = false;  // the peer's one authenticated connection here
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    unauthenticated_.erase(connection.get());
    if (s->peer >= 0) {
      auto it = authenticated_.find(s->peer);
      if (it != authenticated_.end()) {
        std::shared_ptr<Connection> held = it->second.lock();
        current = held == connection;
        if (held == nullptr || held == connection) authenticated_.erase(it);
      }
    }
  }
  // A peer's connection that carried our calls too (share_incoming).
  if (shared && forget_link(s->peer, connection.get())) {
    link_lost(*s, std::move(why));
    return;
  }
  // A peer that only ever called us (an RRef holder calling its owner) is lost when its
  // connection goes: nothing else would tell. One we have a connection to is judged by
  // that connection, which fails too if the peer died; a peer may close its side for
  // other reasons (it retired us, or suspects us). kCancelled is a close of ours (or a
  // connection the peer replaced), not a loss.
  if (current && s->stage == Stage::kOpen && why.code() != absl::StatusCode::kCancelled && !shut_down_.load() &&
      leaving_.load() == 0 && !linked_to(s->peer)) {
    on_peer_lost(s->peer, absl::UnavailableError(absl::StrCat("worker \"", s->peer_name, "\" (id ", s->peer,
                                                              ") is unreachable: its connection here ended: ",
                                                              why.message())));
    return;
  }
  // The caller going away (kUnavailable) or our own close is routine; anything else
  // (a message too large, one that did not parse) is worth a line.
  if (!shut_down_.load() && why.code() != absl::StatusCode::kUnavailable &&
      why.code() != absl::StatusCode::kCancelled && s->stage != Stage::kRefused) {
    FERRY_LOG(WARNING) << self_.name << ": dropping connection from " << describe(*s) << ": " << why;
  }
}

void Agent::link_lost(const Session& s, absl::Status why) {
  if (why.code() == absl::StatusCode::kUnavailable || why.code() == absl::StatusCode::kCancelled) {
    why = absl::UnavailableError(
        absl::StrCat("worker \"", s.peer_name, "\" (id ", s.peer, ") is unreachable: ", why.message()));
  }
  on_peer_lost(s.peer, std::move(why));
}

// ---- The handshake (agents/core/handshake.h).

void Agent::refuse(const std::shared_ptr<Connection>& connection, std::string_view why, std::string_view tell) {
  Session& s = *connection->session();
  FERRY_LOG(WARNING) << self_.name << ": refusing a pipe from " << describe(s) << ": " << why;
  handshakes_refused_.fetch_add(1, std::memory_order_relaxed);
  s.stage = Stage::kRefused;
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    unauthenticated_.erase(connection.get());
  }
  connection->write(internal::auth_message(AuthKind::kRefused, {tell}));
  connection->close_after_writes();
}

absl::Status Agent::check_claim(int id, const std::string& claimed) const {
  // A name or id the table gives someone else is refused. One not in the table yet (a
  // peer faster than our set_members) passes on the token alone.
  absl::StatusOr<WorkerInfo> by_id = worker_info(id);
  if (by_id.ok() && by_id->name != claimed) {
    return absl::PermissionDeniedError(
        absl::StrCat("the membership names worker id ", id, " \"", by_id->name, "\", not \"", claimed, "\""));
  }
  absl::StatusOr<WorkerInfo> by_name = worker_info(claimed);
  if (by_name.ok() && by_name->id != id) {
    return absl::PermissionDeniedError(
        absl::StrCat("the membership gives worker \"", claimed, "\" id ", by_name->id, ", not ", id));
  }
  return absl::OkStatus();
}

void Agent::on_hello(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  Session& s = *connection->session();
  const std::string& token = options_.auth_token;
  std::optional<std::vector<std::string>> hello = internal::parse_auth(wire, AuthKind::kHello, 3);
  if (!hello) {
    if (token.empty()) {
      refuse(connection, "it sent no hello", "every connection must open with a hello naming its worker");
    } else {
      refuse(connection, "it sent no job-token hello (FERRY_AUTH_TOKEN unset on that worker?)",
             absl::StrCat("worker \"", self_.name, "\" requires the job token and this pipe presented none: ",
                          "set FERRY_AUTH_TOKEN to the job's secret on every worker"));
    }
    return;
  }
  std::string claimed = (*hello)[0];
  const std::string& nonce_c = (*hello)[2];
  int id = -1;
  s.peer_name = claimed;
  if (!absl::SimpleAtoi((*hello)[1], &id) || id < 0 || (!nonce_c.empty() && nonce_c.size() != internal::auth::kNonceBytes)) {
    refuse(connection, "malformed hello", "malformed hello");
    return;
  }
  if (token.empty()) {
    if (!nonce_c.empty()) {
      refuse(connection, "it presents a job token and this worker has none (FERRY_AUTH_TOKEN unset here)",
             absl::StrCat("worker \"", self_.name, "\" has no job token but this pipe presented one: set ",
                          "FERRY_AUTH_TOKEN to the same secret on every worker"));
      return;
    }
    // Without a token the claim is taken at its word: it names the caller, nothing more.
    s.peer = id;
    {
      // The latest connection from an id speaks for it (on_closed reports its loss).
      std::lock_guard<std::mutex> lock(accepted_mu_);
      authenticated_[id] = connection;
    }
    authenticated(*connection);
    allow_sharing(*connection);
    return;
  }
  if (nonce_c.empty()) {
    refuse(connection, "it sent no job-token hello (FERRY_AUTH_TOKEN unset on that worker?)",
           absl::StrCat("worker \"", self_.name, "\" requires the job token and this pipe presented none: ",
                        "set FERRY_AUTH_TOKEN to the job's secret on every worker"));
    return;
  }
  if (absl::Status member = check_claim(id, claimed); !member.ok()) {
    refuse(connection, absl::StrCat("it claims to be worker \"", claimed, "\" (id ", id, "): ", member.message()),
           absl::StrCat("worker \"", self_.name, "\" refused the claim to be worker \"", claimed, "\" (id ", id,
                        "): ", member.message()));
    return;
  }
  s.peer = id;
  s.nonce_c = nonce_c;
  s.nonce_s = internal::auth::nonce();
  std::string proof_s = internal::pipe_proof(token, "ferry-pipe-server", s.nonce_c, s.nonce_s, claimed, id, self_.name);
  s.stage = Stage::kAwaitProof;
  connection->write(internal::auth_message(AuthKind::kChallenge, {s.nonce_s, proof_s}));
}

void Agent::on_proof(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  Session& s = *connection->session();
  std::optional<std::vector<std::string>> proof = internal::parse_auth(wire, AuthKind::kProof, 1);
  std::string expected = internal::pipe_proof(options_.auth_token, "ferry-pipe-client", s.nonce_c, s.nonce_s,
                                              s.peer_name, s.peer, self_.name);
  if (!proof || !internal::auth::same_digest((*proof)[0], expected)) {
    refuse(connection, "wrong job token (its proof does not match this worker's FERRY_AUTH_TOKEN)",
           absl::StrCat("the job token differs from worker \"", self_.name,
                        "\"'s: set FERRY_AUTH_TOKEN to the same secret on every worker"));
    return;
  }
  // The newer of two pipes claiming one id wins: a worker opens a second only when it
  // lost its first (a restarted process, a host that vanished without a FIN), and the
  // older one, still open here, is stale (issue 27, finding 7: it refused the
  // replacement). The claim was proved with the token and fits the membership.
  std::shared_ptr<Connection> replaced;
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    auto [it, fresh] = authenticated_.try_emplace(s.peer, connection);
    if (!fresh) {
      replaced = it->second.lock();
      it->second = connection;
    }
  }
  if (replaced != nullptr) {
    FERRY_LOG(WARNING) << self_.name << ": a new pipe from worker \"" << s.peer_name << "\" (id " << s.peer
                       << ") replaces its older one, which is closed (a restarted worker, or one whose old pipe "
                          "went stale)";
    // Out of the table already: its close reports no loss. Our calls that it carried
    // will not be answered by whoever now holds that id.
    if (forget_link(s.peer, replaced.get())) {
      calls_->fail_peer(s.peer, absl::UnavailableError(absl::StrCat(
                                    "worker \"", s.peer_name, "\" (id ", s.peer,
                                    ") replaced the connection this call went on (a restarted worker?)")));
    }
    replaced->close();
  }
  authenticated(*connection);
  connection->write(internal::auth_message(AuthKind::kAccepted, {}));
  // Only behind the verdict may our own calls follow on it.
  allow_sharing(*connection);
}

void Agent::authenticated(Connection& connection) {
  Session& s = *connection.session();
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    unauthenticated_.erase(&connection);
  }
  s.stage = Stage::kOpen;
  s.open.store(true, std::memory_order_release);
}

void Agent::on_challenge(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  Session& s = *connection->session();
  if (internal::refusal(wire)) {
    on_verdict(connection, wire);
    return;
  }
  std::optional<std::vector<std::string>> challenge = internal::parse_auth(wire, AuthKind::kChallenge, 2);
  if (!challenge) {
    fail_link(connection, absl::UnauthenticatedError(absl::StrCat(
                              "worker \"", s.peer_name, "\" did not answer the job-token hello with a challenge")));
    return;
  }
  const std::string& token = options_.auth_token;
  s.nonce_s = (*challenge)[0];
  s.acceptor_proved = internal::auth::same_digest(
      (*challenge)[1],
      internal::pipe_proof(token, "ferry-pipe-server", s.nonce_c, s.nonce_s, self_.name, self_.id, s.peer_name));
  // Our proof goes even when the acceptor's does not check out, so that it logs why it
  // refuses us too; our requests follow it only when the acceptor proved the token. The
  // stage moves first: a transport may deliver the verdict inside write().
  s.stage = Stage::kProved;
  connection->write(internal::auth_message(
      AuthKind::kProof,
      {internal::pipe_proof(token, "ferry-pipe-client", s.nonce_c, s.nonce_s, self_.name, self_.id, s.peer_name)}));
  if (s.acceptor_proved) flush(connection);
}

void Agent::on_verdict(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  Session& s = *connection->session();
  absl::Status failed;
  if (std::optional<std::string> reason = internal::refusal(wire)) {
    failed = absl::UnauthenticatedError(
        absl::StrCat("worker \"", s.peer_name, "\" refused this worker's pipe: ", *reason));
  } else if (!internal::parse_auth(wire, AuthKind::kAccepted, 0) || s.stage != Stage::kProved) {
    failed = absl::UnauthenticatedError(
        absl::StrCat("worker \"", s.peer_name, "\" sent no verdict on the job-token proof"));
  } else if (!s.acceptor_proved) {
    failed = absl::UnauthenticatedError(absl::StrCat(
        "worker \"", s.peer_name, "\" could not prove it knows this worker's job token: ",
        "FERRY_AUTH_TOKEN differs between the workers; set the same secret on every worker"));
  } else {
    s.stage = Stage::kOpen;
    return;
  }
  fail_link(connection, std::move(failed));
}

// ---- Requests and replies.

void Agent::fail_link(const std::shared_ptr<Connection>& connection, absl::Status why) {
  Session& s = *connection->session();
  s.stage = Stage::kRefused;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    auto it = links_.find(s.peer);
    if (it == links_.end() || it->second.connection != connection) return;
    links_.erase(it);
  }
  connection->close();
  on_peer_lost(s.peer, std::move(why));
}

void Agent::on_request(const std::shared_ptr<Connection>& from, Wire wire) {
  Session& s = *from->session();
  absl::StatusOr<Message> request = Message::parse(std::move(wire.metadata), std::move(wire.tensors));
  if (!request.ok()) {
    FERRY_LOG(WARNING) << self_.name << ": dropping connection from " << describe(s) << ": " << request.status();
    s.stage = Stage::kRefused;
    from->close();
    return;
  }
  if (request->type() == MessageType::kPing) {
    // Answered here: no user code runs, so the transport thread may do it.
    Message pong(MessageType::kResponse, request->id());
    from->write(Wire{pong.seal(), {}, {}});
    return;
  }
  if (request->type() != MessageType::kRequest && request->type() != MessageType::kControl) {
    FERRY_LOG(WARNING) << self_.name << ": ignoring a " << message_type_name(request->type()) << " message from "
                       << describe(s) << " on a request pipe";
    return;
  }
  const Clock::time_point arrived = Clock::now();
  const AgentStats::Request observed =
      stats_->request_received(s.peer_name, internal::call_name(*request),
                               internal::wire_bytes(request->buffer().size(), request->tensors()), arrived);
  if (request->type() == MessageType::kRequest && leaving_.load(std::memory_order_acquire) == 2) {
    Message refused = make_error_message(
        request->id(), self_.name,
        absl::UnavailableError(absl::StrCat("worker \"", self_.name, "\" (id ", self_.id,
                                            ") is leaving the group and takes no new calls")));
    from->write(Wire{refused.seal(), {}, {}});
    return;
  }
  if (request->type() == MessageType::kRequest) {
    const int cap = options_.max_requests_in_flight;
    const int serving = s.serving.fetch_add(1, std::memory_order_seq_cst) + 1;
    if (serving > cap) {
      // Reads stop at the cap (below), so only a transport that delivers past a pause
      // gets here; the last line of defence still queues nothing (issue 27, finding 10).
      s.serving.fetch_sub(1, std::memory_order_seq_cst);
      requests_refused_.fetch_add(1, std::memory_order_relaxed);
      Message refused = make_error_message(
          request->id(), self_.name,
          absl::ResourceExhaustedError(absl::StrCat(
              "worker \"", self_.name, "\" already has ", cap, " requests from ", describe(s),
              " in flight (max_requests_in_flight); this one was refused unrun")));
      from->write(Wire{refused.seal(), {}, {}});
      return;
    }
    int peak = serving_peak_.load(std::memory_order_relaxed);
    while (serving > peak && !serving_peak_.compare_exchange_weak(peak, serving, std::memory_order_relaxed)) {
    }
    // A caller with a larger cap, or one that is not ferry, then waits in its own
    // transport rather than in this worker's memory.
    if (serving >= cap) pause_reads(from);
  }
  if (request->type() == MessageType::kRequest && !any_device_target(wire.targets) && options_.serves_inline &&
      !internal::driving_for_user() && options_.serves_inline(*request)) {
    // No hop: the handler promised not to block. Counted like a pool task, so sync()
    // and join() see it. Never on a user's thread that delivers while it waits: it may
    // hold a lock the handler takes.
    activity_->enter();
    {
      InlineServingScope scope;
      serve(from, std::move(wire.targets), *std::move(request), arrived, observed);
    }
    activity_->exit();
    return;
  }
  std::weak_ptr<Agent> weak = weak_from_this();
  pool_->post([weak, from, targets = std::move(wire.targets), request = *std::move(request), arrived,
               observed]() mutable {
    if (std::shared_ptr<Agent> agent = weak.lock()) {
      agent->serve(from, std::move(targets), std::move(request), arrived, observed);
    }
  });
}

void Agent::serve(const std::shared_ptr<Connection>& from, std::vector<std::string> targets, Message request,
                  Clock::time_point arrived, AgentStats::Request observed) {
  AgentStats::request_started(observed);
  Served served{observed, trace_ ? AgentStats::Clock::now() : AgentStats::Clock::time_point{}, std::string()};
  if (trace_) served.function = internal::call_name(request);
  const Session& s = *from->session();
  // The table is held for the whole request: the handler gets its entry by reference.
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(s.peer_name);
  // A caller not in the table yet (a fast peer of a static group calls before this
  // worker has read everyone's address) is named by the id its hello claimed, so that
  // what it holds here (an RRef fork) is dropped when it is lost.
  const WorkerInfo unknown{member == nullptr ? s.peer_name : std::string(), member == nullptr ? s.peer : -1};
  const WorkerInfo& caller = member == nullptr ? unknown : member->info;
  // Tensors bound for a device land here, on the pool: a device copy must not hold
  // up the transport.
  const bool counted = request.type() == MessageType::kRequest;
  // A request its caller gave up on (it waited here past its timeout) is not run: the
  // caller failed it already, and running it would only feed a backlog.
  const std::optional<std::chrono::milliseconds> timeout = request.timeout();
  const std::chrono::milliseconds waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - arrived);
  if (timeout && waited >= *timeout) {
    send_reply(from, member, caller, request.id(), counted, served,
               make_error_message(request.id(), self_.name,
                                  absl::DeadlineExceededError(absl::StrCat(
                                      self_.name, ": the request waited ", waited.count(),
                                      " ms to run, past its caller's timeout of ", timeout->count(),
                                      " ms; it was dropped unrun"))));
    return;
  }
  absl::Status landed = targets.empty() ? absl::OkStatus() : land(request.tensors(), targets);
  Message reply;
  ServingRequest serving{from, table, member, caller, request.id(), counted, served};
  if (!landed.ok()) {
    reply = make_error_message(request.id(), self_.name,
                               absl::Status(landed.code(), absl::StrCat(self_.name, ": ", landed.message())));
  } else {
    ServingScope scope(this, &serving);
    try {
      if (request.type() == MessageType::kControl) {
        std::shared_ptr<const RequestHandler> control;
        {
          std::lock_guard<std::mutex> lock(hooks_mu_);
          control = control_handler_;
        }
        reply = control ? (*control)(request, caller)
                        : make_error_message(request.id(), self_.name,
                                             absl::UnimplementedError(absl::StrCat(
                                                 self_.name, ": this agent takes no control messages")));
      } else {
        reply = handler_(request, caller);
      }
    } catch (const std::exception& e) {
      reply = make_error_message(
          request.id(), self_.name,
          absl::UnknownError(absl::StrCat(self_.name, ": request handler threw: ", e.what())));
    } catch (...) {
      reply = make_error_message(request.id(), self_.name,
                                 absl::UnknownError(absl::StrCat(self_.name, ": request handler threw")));
    }
  }
  // A deferred reply goes when its handler's continuation sends it (see defer()).
  if (serving.deferred) return;
  send_reply(from, member, caller, request.id(), counted, served, std::move(reply));
}

void Agent::pause_reads(const std::shared_ptr<Connection>& connection) {
  Session& s = *connection->session();
  bool keepalive = false;
  {
    std::lock_guard<std::mutex> lock(s.flow_mu);
    // A connection carrying calls both ways is never paused: the replies to this
    // worker's own calls would wait behind it. Requests past the cap are refused.
    if (s.outgoing || s.shared.load(std::memory_order_acquire)) return;
    // The flag goes up before the count is read again, and a reply lowers the count
    // before it reads the flag: one of the two sees the other, so a reply that came
    // meanwhile never leaves the connection paused with room under the cap.
    s.reads_paused.store(true, std::memory_order_seq_cst);
    if (s.serving.load(std::memory_order_seq_cst) < options_.max_requests_in_flight) {
      s.reads_paused.store(false, std::memory_order_seq_cst);
      return;
    }
    connection->pause_reads();
    reads_paused_.fetch_add(1, std::memory_order_relaxed);
    keepalive = options_.heartbeat.count() > 0 && !s.keepalive_armed;
    if (keepalive) s.keepalive_armed = true;
  }
  if (keepalive) keep_alive(connection);
}

void Agent::resume_reads(Connection& connection) {
  Session& s = *connection.session();
  std::lock_guard<std::mutex> lock(s.flow_mu);
  if (!s.reads_paused.load(std::memory_order_seq_cst) ||
      s.serving.load(std::memory_order_seq_cst) >= options_.max_requests_in_flight) {
    return;
  }
  s.reads_paused.store(false, std::memory_order_seq_cst);
  connection.resume_reads();
}

void Agent::keep_alive(const std::shared_ptr<Connection>& connection) {
  std::weak_ptr<Agent> weak = weak_from_this();
  std::weak_ptr<Connection> weak_connection = connection;
  calls_->run_at(Clock::now() + std::max(options_.heartbeat / 4, std::chrono::milliseconds(1)),
                 [weak, weak_connection] {
                   std::shared_ptr<Agent> agent = weak.lock();
                   std::shared_ptr<Connection> c = weak_connection.lock();
                   if (!agent || !c) return;
                   Session& s = *c->session();
                   {
                     std::lock_guard<std::mutex> lock(s.flow_mu);
                     if (!s.reads_paused.load(std::memory_order_seq_cst)) {
                       s.keepalive_armed = false;
                       return;
                     }
                   }
                   c->write(Wire{Message(MessageType::kBusy, 0).seal(), {}, {}});
                   agent->keep_alive(c);
                 });
}

void Agent::send_reply(const std::shared_ptr<Connection>& from, const Member* member, const WorkerInfo& caller,
                       uint64_t id, bool counted, const Served& served, Message reply) {
  if (counted) {
    Session& s = *from->session();
    s.serving.fetch_sub(1, std::memory_order_seq_cst);
    if (s.reads_paused.load(std::memory_order_seq_cst)) resume_reads(*from);
  }
  reply.set_id(id);
  requests_served_.fetch_add(1, std::memory_order_relaxed);
  absl::StatusCode outcome =
      reply.type() == MessageType::kError ? error_from_message(reply).code() : absl::StatusCode::kOk;
  Wire wire;
  wire.tensors = std::move(reply.tensors());
  absl::Status staged = absl::OkStatus();
  if (!wire.tensors.empty()) {
    // Only device tensors need the reverse maps, through the caller's channel.
    std::shared_ptr<const DeviceMaps> reverse = reverse_device_maps();
    DeviceChannel& channel = member == nullptr ? *staging_ : channel_for(*member);
    staged = channel.stage_outgoing(wire.tensors, wire.targets, map_towards(*reverse, caller.name), caller.name);
  }
  if (staged.ok()) {
    wire.metadata = reply.seal();
  } else {
    // The result holds a tensor that cannot travel back: the caller gets why.
    Message error = make_error_message(
        id, self_.name,
        absl::Status(staged.code(), absl::StrCat(self_.name, ": the reply cannot be sent: ", staged.message())));
    wire = Wire{error.seal(), {}, {}};
    outcome = staged.code();
  }
  AgentStats::request_finished(served.observed, outcome, internal::wire_bytes(wire.metadata.size(), wire.tensors));
  if (trace_ && served.observed.cell != nullptr) {
    const Session& s = *from->session();
    trace_->served(s.peer, s.peer_name, served.function, id, served.observed.received, served.started,
                   AgentStats::Clock::now());
  }
  from->write(std::move(wire));
}

// ---- Deferred replies (agents/rpc_agent.h's defer_reply).

struct DeferredReply::State {
  // Sends the reply or an error for it, and counts the request out; called once.
  std::function<void(absl::StatusOr<Message>)> deliver;
  std::atomic<bool> done{false};
  ~State() {
    if (!done.exchange(true)) {
      deliver(absl::InternalError("the request's handler deferred its reply, then dropped it without sending one"));
    }
  }
};

void DeferredReply::send(Message reply) const {
  if (state_ == nullptr || state_->done.exchange(true)) return;
  state_->deliver(std::move(reply));
}

namespace {
thread_local Agent::ServingRequest* serving_now = nullptr;
}  // namespace

Agent::ServingScope::ServingScope(Agent* agent, ServingRequest* request) : previous_(serving_now) {
  request->agent = agent;
  serving_now = request;
}
Agent::ServingScope::~ServingScope() { serving_now = previous_; }

DeferredReply defer_reply(std::optional<std::chrono::milliseconds> timeout) {
  if (serving_now == nullptr || serving_now->deferred) return DeferredReply();
  return serving_now->agent->defer(*serving_now, timeout);
}

DeferredReply Agent::defer(ServingRequest& request, std::optional<std::chrono::milliseconds> timeout) {
  request.deferred = true;
  // Counted like the pool task it replaces, so sync() and join() wait for the reply.
  activity_->enter();
  auto state = std::make_shared<DeferredReply::State>();
  std::weak_ptr<Agent> weak = weak_from_this();
  state->deliver = [weak, activity = activity_, from = request.from, table = request.table, member = request.member,
                    caller = request.caller, id = request.id, counted = request.counted,
                    served = request.served](absl::StatusOr<Message> reply) {
    if (std::shared_ptr<Agent> agent = weak.lock()) {
      Message m = reply.ok() ? *std::move(reply)
                             : make_error_message(id, agent->self_.name,
                                                  absl::Status(reply.status().code(),
                                                               absl::StrCat(agent->self_.name, ": ",
                                                                            reply.status().message())));
      agent->send_reply(from, member, caller, id, counted, served, std::move(m));
    }
    activity->exit();
  };
  if (timeout.has_value()) {
    std::weak_ptr<DeferredReply::State> weak_state = state;
    calls_->run_at(Clock::now() + *timeout, [weak_state, limit = *timeout] {
      std::shared_ptr<DeferredReply::State> s = weak_state.lock();
      if (s == nullptr || s->done.exchange(true)) return;
      s->deliver(absl::DeadlineExceededError(
          absl::StrCat("the reply to this request was not ready within ", limit.count(), " ms")));
    });
  }
  return DeferredReply(std::move(state));
}

void Agent::on_reply(int peer, Wire wire) {
  if (any_device_target(wire.targets)) {
    // A device copy must not run on the transport thread: land on the pool. Counted in
    // before the call is counted out, so sync() never sees zero in between.
    std::weak_ptr<Agent> weak = weak_from_this();
    // Refused only while shutting down, when the call fails with kCancelled anyway.
    (void)pool_->post([weak, peer, wire = std::move(wire)]() mutable {
      std::shared_ptr<Agent> agent = weak.lock();
      if (!agent) return;
      absl::StatusOr<Message> reply = Message::parse(std::move(wire.metadata), std::move(wire.tensors));
      if (!reply.ok()) {
        agent->drop_connection(peer);
        agent->on_peer_lost(peer, absl::DataLossError(absl::StrCat("bad reply from worker id ", peer, ": ",
                                                                   reply.status().message())));
        return;
      }
      agent->complete_reply(peer, std::move(wire.targets), *std::move(reply));
    });
    return;
  }
  absl::StatusOr<Message> reply = Message::parse(std::move(wire.metadata), std::move(wire.tensors));
  if (!reply.ok()) {
    drop_connection(peer);
    on_peer_lost(peer, absl::DataLossError(absl::StrCat("bad reply from worker id ", peer, ": ",
                                                        reply.status().message())));
    return;
  }
  complete_reply(peer, {}, *std::move(reply));
}

void Agent::complete_reply(int peer, std::vector<std::string> targets, Message reply) {
  uint64_t id = reply.id();
  absl::Status landed = targets.empty() ? absl::OkStatus() : land(reply.tensors(), targets);
  bool settled = true;
  if (!landed.ok()) {
    settled = calls_->complete_from(peer, id, landed);
  } else if (reply.type() == MessageType::kError) {
    settled = calls_->complete_from(peer, id, error_from_message(reply));
  } else if (reply.type() == MessageType::kResponse) {
    settled = calls_->complete_from(peer, id, std::move(reply));
  } else if (reply.type() == MessageType::kBusy) {
    calls_->heard(peer);
  } else {
    FERRY_LOG(WARNING) << self_.name << ": ignoring a " << message_type_name(reply.type())
                       << " message from worker id " << peer << " on a reply pipe";
  }
  // Not pending (timed out, failed) or not a call to that worker: a reply to another
  // worker's call is forged or misrouted, and dropped.
  if (!settled) FERRY_LOG(DEBUG) << self_.name << ": dropped a reply from worker id " << peer << " to call " << id;
}

absl::StatusOr<WorkerInfo> Agent::worker_info(std::string_view name) const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  if (const Member* m = table->find(name)) return m->info;
  return table->absent(name);
}

absl::StatusOr<WorkerInfo> Agent::worker_info(int id) const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  if (const Member* m = table->find(id)) return m->info;
  return table->absent(id);
}

std::vector<WorkerInfo> Agent::worker_infos() const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  std::vector<WorkerInfo> out;
  out.reserve(table->by_id.size());
  for (const auto& [id, m] : table->by_id) out.push_back(m.info);
  std::sort(out.begin(), out.end(), [](const WorkerInfo& a, const WorkerInfo& b) { return a.id < b.id; });
  return out;
}

void Agent::close_incoming(int peer) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    auto it = authenticated_.find(peer);
    if (it == authenticated_.end()) return;
    connection = it->second.lock();
    authenticated_.erase(it);
  }
  // Out of the table first (and out of the links, if our calls rode on it): its close
  // reports no second loss.
  if (connection != nullptr) {
    forget_link(peer, connection.get());
    connection->close();
  }
}

void Agent::on_peer_lost(int peer, absl::Status why) {
  if (shut_down_.load()) {
    calls_->fail_peer(peer, absl::CancelledError("the agent shut down"));
    return;
  }
  // A lost peer that stopped (or whose host vanished) never closes its side of the
  // pipe it opened to us; that pipe would keep its id (issue 27, finding 7). One that
  // left (join() saw it arrive) closes its own.
  if (!departing_.load()) close_incoming(peer);
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(peer);
  if (member == nullptr) {
    calls_->fail_peer(peer, why);
    return;
  }
  WorkerInfo info = member->info;
  // Once join() saw everyone arrive, the group is shutting down: peers going now left.
  const MembershipChange change = departing_.load() ? MembershipChange::kLeft : MembershipChange::kLost;
  if (change == MembershipChange::kLost) FERRY_LOG(INFO) << self_.name << ": " << why;
  if (dynamic_.load()) {
    // A dynamic group forgets a lost member; its calls fail with why it was lost.
    calls_->fail_peer(peer, why);
    if (members_.remove(peer, change).ok()) {
      group_size_.fetch_sub(1);
      notify(info, change);
    }
    return;
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    first = lost_.emplace(peer, why).second;
    any_lost_.store(true, std::memory_order_release);
  }
  calls_->fail_peer(peer, why);
  if (!first) return;
  MembershipChange decided;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    // Decided under the lock join() holds when it leaves the barrier and turns
    // departing_ on: judged before, a peer that left just as this worker's join()
    // finished would be reported lost.
    decided = departing_.load() ? MembershipChange::kLeft : MembershipChange::kLost;
    if (in_barrier_.load()) {
      // Waiting in join(): the loss is accounted in the store (not on a transport
      // thread), and whether it left or was lost shows once everyone is accounted.
      deferred_.push_back(info);
      if (!barrier_prefix_.empty()) {
        std::weak_ptr<Agent> weak = weak_from_this();
        pool_->post([weak, prefix = barrier_prefix_, n = barrier_size_, peer] {
          std::shared_ptr<Agent> agent = weak.lock();
          if (agent == nullptr) return;
          absl::Status accounted = agent->account(prefix, peer, /*arrived=*/false, n).status();
          if (!accounted.ok()) FERRY_LOG(WARNING) << agent->self_.name << ": accounting a lost peer: " << accounted;
        });
      }
      return;
    }
  }
  notify(info, decided);
}

void Agent::suspect(int peer, std::chrono::milliseconds wait) {
  {
    std::lock_guard<std::mutex> lock(pinging_mu_);
    if (!pinging_.insert(peer).second) return;  // one ping at a time
  }
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(peer);
  std::string name = member != nullptr ? member->info.name : absl::StrCat("id ", peer);
  std::weak_ptr<Agent> weak = weak_from_this();
  const Clock::time_point pinged = Clock::now();
  send(peer, Message(MessageType::kPing, 0), wait)
      .add_callback([weak, peer, name, wait, pinged](const absl::StatusOr<Message>& pong) {
        std::shared_ptr<Agent> core = weak.lock();
        if (!core) return;
        {
          std::lock_guard<std::mutex> lock(core->pinging_mu_);
          core->pinging_.erase(peer);
        }
        // A reply to any other call since the ping proves the peer alive: the ping may
        // only be queued behind a burst of requests.
        if (pong.status().code() == absl::StatusCode::kDeadlineExceeded && core->calls_->last_heard(peer) < pinged) {
          core->drop_connection(peer);
          core->on_peer_lost(peer, absl::UnavailableError(absl::StrCat(
                                       "worker \"", name, "\" (id ", peer, ") did not answer a heartbeat within ",
                                       wait.count(), " ms; declared lost")));
        }
      });
}

void Agent::watch(int peer, bool watched) {
  if (options_.heartbeat.count() == 0 || peer == self_.id) return;
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    if (!watched) {
      watched_.erase(peer);
      return;
    }
    watched_.insert(peer);
    if (watching_) return;
    watching_ = true;
  }
  std::weak_ptr<Agent> weak = weak_from_this();
  calls_->run_at(Clock::now() + options_.heartbeat / 2, [weak] {
    if (std::shared_ptr<Agent> agent = weak.lock()) agent->check_watched();
  });
}

void Agent::check_watched() {
  std::vector<int> peers;
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    if (watched_.empty() || shut_down_.load()) {
      watching_ = false;
      return;
    }
    peers.assign(watched_.begin(), watched_.end());
  }
  // A peer heard from within the last half heartbeat needs no ping.
  const Clock::time_point recent = Clock::now() - options_.heartbeat / 2;
  for (int peer : peers) {
    if (calls_->last_heard(peer) < recent) suspect(peer, options_.heartbeat / 2);
  }
  std::weak_ptr<Agent> weak = weak_from_this();
  calls_->run_at(Clock::now() + options_.heartbeat / 2, [weak] {
    if (std::shared_ptr<Agent> agent = weak.lock()) agent->check_watched();
  });
}

void Agent::add_membership_listener(MembershipListener listener) {
  std::lock_guard<std::mutex> lock(listeners_mu_);
  listeners_.push_back(std::move(listener));
}

void Agent::notify(WorkerInfo worker, MembershipChange change) {
  {
    std::lock_guard<std::mutex> lock(changes_mu_);
    changes_.emplace_back(std::move(worker), change);
    if (delivering_) return;  // the task already running delivers this one too
    delivering_ = true;
  }
  std::weak_ptr<Agent> weak = weak_from_this();
  bool posted = pool_->post([weak] {
    if (std::shared_ptr<Agent> core = weak.lock()) core->deliver_changes();
  });
  if (!posted) {
    std::lock_guard<std::mutex> lock(changes_mu_);
    changes_.clear();  // the pool has shut down: no listener runs any more
    delivering_ = false;
  }
}

void Agent::deliver_changes() {
  for (;;) {
    std::pair<WorkerInfo, MembershipChange> next;
    {
      std::lock_guard<std::mutex> lock(changes_mu_);
      if (changes_.empty()) {
        delivering_ = false;
        return;
      }
      next = std::move(changes_.front());
      changes_.pop_front();
    }
    std::lock_guard<std::mutex> lock(listeners_mu_);
    for (const MembershipListener& listener : listeners_) {
      run_callback_guarded([&] { listener(next.first, next.second); });
    }
  }
}

absl::Status Agent::sync(std::chrono::milliseconds timeout) {
  if (!activity_->wait_idle(timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(self_.name, ": ", calls_->pending(), " call(s) and ",
                                                    pool_->queued(), " queued task(s) still unfinished after ",
                                                    timeout.count(), " ms"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Agent::account(const std::string& prefix, int id, bool arrived, int n) {
  // A unique claim value, so a claimer knows whether it won (compare_set returns what
  // the key holds afterwards).
  const Bytes mine = to_bytes(arrived ? std::string("arrived") : absl::StrCat("lost:", self_.id));
  FERRY_ASSIGN_OR_RETURN(Bytes holds, store_->compare_set(absl::StrCat(prefix, "fate/", id), {}, mine));
  if (holds != mine) return 0;  // accounted for already
  // "arrived" counts before "accounted", so it is final once "done" is set.
  int64_t order = 0;
  if (arrived) {
    FERRY_ASSIGN_OR_RETURN(order, store_->add(prefix + "arrived", 1));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t accounted, store_->add(prefix + "accounted", 1));
  if (accounted == n) FERRY_RETURN_IF_ERROR(store_->set(prefix + "done", to_bytes("1")));
  return order;
}

absl::Status Agent::join(std::chrono::milliseconds timeout) {
  std::shared_ptr<const std::function<absl::Status(std::chrono::milliseconds)>> custom;
  {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    custom = join_;
  }
  if (custom) {
    absl::Status left = (*custom)(timeout);
    // Only a worker that did leave says so: one whose leave was refused stays a member.
    if (left.ok() && metrics_) metrics_->retire(*store_);
    return left;
  }
  Clock::time_point deadline = Clock::now() + timeout;
  int n = group_size_.load();
  std::string prefix = absl::StrCat(options_.store_prefix, "join/", join_generation_.fetch_add(1), "/");
  // Every call is rooted in some worker's own unfinished work, so once each worker has
  // drained its own and arrived, the whole group is quiet.
  FERRY_RETURN_IF_ERROR(sync(timeout));
  // Every worker is accounted for once: by itself when it arrives, or by any worker
  // that saw it lost. A worker that never arrives and that nobody has a connection to
  // is probed, so a dead one is found within a probe.
  in_barrier_.store(true);
  absl::Status barrier = wait_in_barrier(prefix, n, deadline);
  std::vector<WorkerInfo> deferred;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    in_barrier_.store(false);
    barrier_prefix_.clear();
    // Everyone arrived or was lost: whoever goes now leaves.
    if (barrier.ok()) departing_.store(true);
    deferred.swap(deferred_);
  }
  for (const WorkerInfo& w : deferred) {
    absl::StatusOr<Bytes> fate = store_->get(absl::StrCat(prefix, "fate/", w.id), std::chrono::milliseconds(0));
    bool left = barrier.ok() && fate.ok() && to_string(*fate) == "arrived";
    notify(w, left ? MembershipChange::kLeft : MembershipChange::kLost);
  }
  FERRY_RETURN_IF_ERROR(barrier);
  FERRY_ASSIGN_OR_RETURN(int64_t arrived, store_->add(prefix + "arrived", 0));
  // Before "left": worker 0, which usually hosts the store, waits for every "left"
  // before it goes.
  if (metrics_) metrics_->retire(*store_);
  // Worker 0 usually hosts the store: it leaves last, so nobody loses the store while
  // still reading "done".
  FERRY_ASSIGN_OR_RETURN(int64_t gone, store_->add(prefix + "left", 1));
  if (gone == arrived) FERRY_RETURN_IF_ERROR(store_->set(prefix + "all_left", to_bytes("1")));
  if (self_.id == 0) {
    absl::Status left = store_->wait({prefix + "all_left"}, left_until(deadline));
    if (!left.ok()) {
      return absl::Status(left.code(), absl::StrCat(self_.name, ": waiting for every worker to finish joining: ",
                                                    left.message()));
    }
  }
  if (arrived == n) return absl::OkStatus();
  // Some worker was lost: say which, wherever it was seen.
  std::vector<std::string> keys;
  std::vector<WorkerInfo> members = worker_infos();
  for (const WorkerInfo& w : members) keys.push_back(absl::StrCat(prefix, "fate/", w.id));
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> fates, store_->multi_get(keys, left_until(deadline)));
  std::vector<std::string> names;
  for (size_t i = 0; i < members.size(); ++i) {
    if (to_string(fates[i]) == "arrived") continue;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(lost_mu_);
      auto it = lost_.find(members[i].id);
      if (it != lost_.end()) why = absl::StrCat(": ", it->second.message());
    }
    names.push_back(absl::StrCat("\"", members[i].name, "\" (id ", members[i].id, ")", why));
  }
  return absl::UnavailableError(absl::StrCat(self_.name, ": joined the rest of the group, but ", n - arrived,
                                             " worker(s) were lost: ", absl::StrJoin(names, "; ")));
}

absl::Status Agent::wait_in_barrier(const std::string& prefix, int n, Clock::time_point deadline) {
  FERRY_ASSIGN_OR_RETURN(int64_t order, account(prefix, self_.id, /*arrived=*/true, n));
  // Losses seen before now are accounted here; later ones by on_peer_lost.
  std::vector<int> lost;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    barrier_prefix_ = prefix;
    barrier_size_ = n;
    for (const auto& [id, why] : lost_) lost.push_back(id);
  }
  for (int id : lost) FERRY_RETURN_IF_ERROR(account(prefix, id, /*arrived=*/false, n).status());
  // A worker that never arrives and that nobody has a connection to is probed: soon by
  // the first to arrive, later by the others too (in case that one is gone), so a
  // large group does not check every key from every worker.
  const std::chrono::milliseconds every = std::max(options_.heartbeat, kFirstProbe);
  const std::chrono::milliseconds period = order == 1 ? every : 2 * every;
  Clock::time_point next_probe = Clock::now() + (order == 1 ? kFirstProbe : period);
  for (;;) {
    std::chrono::milliseconds slice =
        std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                   std::min(next_probe, deadline) - Clock::now()));
    absl::Status all = store_->wait({prefix + "done"}, slice);
    if (all.ok()) return absl::OkStatus();
    if (all.code() != absl::StatusCode::kDeadlineExceeded || Clock::now() >= deadline) {
      return absl::Status(all.code(), absl::StrCat(self_.name, ": waiting for every worker to join: ", all.message()));
    }
    if (Clock::now() < next_probe) continue;
    for (const WorkerInfo& w : worker_infos()) {
      if (w.id == self_.id) continue;
      absl::StatusOr<bool> accounted = store_->check({absl::StrCat(prefix, "fate/", w.id)});
      if (!accounted.ok() || *accounted) continue;
      if (options_.heartbeat.count() > 0) {
        suspect(w.id, options_.heartbeat);
      } else {
        // Without heartbeats only a peer that refuses the connection is found.
        (void)send(w.id, Message(MessageType::kPing, 0), kFirstProbe);
      }
    }
    next_probe = Clock::now() + period;
  }
}

void Agent::shutdown() {
  if (on_agent_thread()) {
    // Tearing down joins this very thread: refuse rather than deadlock or abort.
    FERRY_LOG(ERROR) << self_.name
                     << ": shutdown() called from one of the agent's own threads (a user function or a future "
                        "callback); call it from a thread of your own";
    return;
  }
  if (shut_down_.exchange(true)) return;
  if (metrics_) metrics_->shutdown();
  if (transport_) transport_->close();
  if (calls_) {
    calls_->fail_all(absl::CancelledError("the agent shut down"));
    calls_->stop();
  }
  if (pool_) pool_->shutdown(kPoolShutdownDeadline);
  if (trace_) {
    if (absl::Status written = trace_->flush(); !written.ok()) FERRY_LOG(WARNING) << self_.name << ": " << written;
  }
}

std::map<std::string, std::string> Agent::debug_info() const {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  std::map<std::string, std::string> info = transport_->debug_info();
  info["worker"] = self_.name;
  info["world_size"] = std::to_string(table->by_id.size());
  info["membership_version"] = std::to_string(table->version);
  info["calls_in_flight"] = std::to_string(calls_->pending());
  info["requests_served"] = std::to_string(requests_served_.load());
  info["num_worker_threads"] = std::to_string(pool_->size());
  info["queued_requests"] = std::to_string(pool_->queued());
  info["pool_wakeups"] = std::to_string(pool_->wakeups());
  info["auth"] = options_.auth_token.empty() ? "none" : "job token";
  info["handshakes_refused"] = std::to_string(handshakes_refused_.load());
  info["reads_paused"] = std::to_string(reads_paused_.load());
  info["requests_refused_at_cap"] = std::to_string(requests_refused_.load());
  info["requests_in_flight_peak"] = std::to_string(serving_peak_.load());
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    size_t on_theirs = 0;
    for (const auto& [id, link] : links_) on_theirs += link.session->outgoing ? 0 : 1;
    info["connections_out"] = std::to_string(links_.size() - on_theirs);
    // Links riding a connection the peer opened (Connection::carries_calls_to).
    info["connections_shared"] = std::to_string(on_theirs);
    info["connections_shared_total"] = std::to_string(links_shared_.load(std::memory_order_relaxed));
  }
  {
    std::lock_guard<std::mutex> lock(accepted_mu_);
    size_t in = 0;
    for (const auto& [id, connection] : authenticated_) in += connection.expired() ? 0 : 1;
    info["connections_in"] = std::to_string(in);
  }
  for (const auto& [key, value] : staging_->debug_info()) info[key] = value;
  for (const std::shared_ptr<DeviceChannel>& channel : options_.device_channels) {
    for (const auto& [key, value] : channel->debug_info()) info[key] = value;
  }
  return info;
}

}  // namespace ferry
