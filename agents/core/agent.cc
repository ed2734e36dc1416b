#include "agents/core/agent.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agents/core/activity.h"
#include "agents/core/call_table.h"
#include "agents/core/join_barrier.h"
#include "agents/core/links.h"
#include "agents/core/liveness.h"
#include "agents/core/observe.h"
#include "agents/core/outbox.h"
#include "agents/core/server.h"
#include "agents/core/session.h"
#include "agents/core/thread_pool.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_role.h"
#include "serialization/archive.h"

namespace ferry {

using internal::CallTable;
using internal::HandshakeStep;
using internal::Links;
using internal::Locked;
using internal::Member;
using internal::Membership;
using internal::Session;
using internal::Stage;

namespace {

using Clock = std::chrono::steady_clock;

// How long shutdown waits for user functions still running on the pool; a function
// that never returns must not hang the process's exit.
constexpr std::chrono::seconds kPoolShutdownDeadline{60};

// join(): how soon a worker that arrived probes one that has not, without heartbeats.
constexpr std::chrono::milliseconds kProbeWithoutHeartbeat{300};

// How long a connection may hold more than AgentOptions::max_unsent_bytes without any
// of it leaving before it is closed. The heartbeat is how long this worker waits to
// hear from a peer before asking, and as long again for the answer before the peer is
// lost; a peer that takes nothing for that long is treated the same. Without
// heartbeats, the call timeout: its replies are then ones their callers gave up on.
std::chrono::milliseconds unsent_deadline(const AgentOptions& options) {
  return options.heartbeat.count() > 0 ? 2 * options.heartbeat : options.rpc_timeout;
}

// Whether a sealed message on a connection that carries calls both ways is a request
// (served here) rather than a reply (to a call of ours), read from its header's type
// byte without parsing it. One too short to tell is a request: the server refuses it.
bool is_request(const std::string& metadata) {
  if (metadata.size() < Message::kHeaderSize) return true;
  const auto type = static_cast<MessageType>(metadata[3]);
  return type != MessageType::kResponse && type != MessageType::kError && type != MessageType::kBusy;
}

// Whether a sealed message is a chunk of a large device tensor (agents/core/cuda_staging.h).
bool is_chunk(const std::string& metadata) {
  return metadata.size() >= Message::kHeaderSize && static_cast<MessageType>(metadata[3]) == MessageType::kChunk;
}

// Whether a sealed message is a device channel's notice (agents/core/device_channel.h).
bool is_notice(const std::string& metadata) {
  return metadata.size() >= Message::kHeaderSize && static_cast<MessageType>(metadata[3]) == MessageType::kNotice;
}

// AgentOptions::device_channel, else FERRY_DEVICE_CHANNEL.
std::string required_channel(const std::optional<std::string>& option) {
  if (option.has_value()) return *option;
  const char* env = std::getenv("FERRY_DEVICE_CHANNEL");
  return env == nullptr ? std::string() : std::string(env);
}

}  // namespace

Agent::Agent(WorkerInfo self, std::shared_ptr<Store> store, AgentOptions options, std::unique_ptr<Transport> transport)
    : self_(std::move(self)),
      store_(std::move(store)),
      options_(std::move(options)),
      transport_(std::move(transport)),
      activity_(std::make_shared<internal::Activity>()),
      channels_(options_.device_channels, options_.device_maps, options_.reverse_device_maps, options_.devices,
                required_channel(options_.device_channel), options_.device_channel_by_peer),
      handshake_(self_.name, self_.id, options_.auth_token) {}

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
  if (options.max_unsent_bytes < (size_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_unsent_bytes must be at least 1 MiB, got ", options.max_unsent_bytes));
  }
  if (options.handshake_timeout.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("handshake_timeout must be > 0 ms, got ",
                                                   options.handshake_timeout.count(), " ms"));
  }
  std::shared_ptr<Agent> agent(new Agent(std::move(self), std::move(store), std::move(options), std::move(transport)));
  agent->build(std::move(handler));
  agent->attach_channels();
  absl::StatusOr<std::string> address = agent->transport_->listen(agent);
  if (!address.ok()) {
    agent->shutdown();
    return address.status();
  }
  agent->address_ = *std::move(address);
  if (agent->store_->has_leases()) {
    // Before any peer learns of this worker, so that its watch finds the record there.
    absl::Status recorded = agent->store_->set_owned(agent->record_key(agent->self_.id), to_bytes(agent->self_.name));
    if (!recorded.ok()) {
      agent->shutdown();
      return recorded;
    }
  }
  absl::StatusOr<std::unique_ptr<internal::PublishedMetrics>> metrics = internal::serve_metrics(
      agent->options_.metrics_port, agent->self_.name, *agent->store_, kMetricsStorePrefix, *agent->stats_,
      [channels = agent->channels_.prometheus(), routes = agent->links_->prometheus()] {
        return channels() + routes();
      });
  if (!metrics.ok()) {
    agent->shutdown();
    return metrics.status();
  }
  agent->metrics_ = *std::move(metrics);
  return agent;
}

void Agent::build(RequestHandler handler) {
  const std::weak_ptr<void> owner = weak_from_this();
  // Every object below reports a lost peer here, whatever thread it found it on.
  auto lost = [this, owner](int peer, absl::Status why) {
    if (std::shared_ptr<void> alive = owner.lock()) on_peer_lost(peer, std::move(why));
  };
  pool_ = std::make_shared<internal::ThreadPool>(options_.num_worker_threads, activity_);
  calls_ = std::make_unique<CallTable>(pool_, activity_);
  barrier_ = std::make_unique<internal::JoinBarrier>(self_, *store_, members_, options_.store_prefix, options_.heartbeat);
  links_ = std::make_unique<Links>(
      self_.name, *transport_, *calls_, handshake_,
      Links::Settings{self_.id, options_.max_requests_in_flight, options_.heartbeat, options_.handshake_timeout,
                      options_.max_unsent_bytes, unsent_deadline(options_)},
      owner, lost);
  outbox_ = std::make_unique<internal::Outbox>(self_, options_.rpc_timeout, members_, *barrier_, channels_, *calls_,
                                               *links_, *pool_, *stats_, trace_.get(), owner, lost);
  server_ = std::make_unique<internal::Server>(
      self_, std::move(handler), internal::Server::Settings{options_.serves_inline, options_.max_requests_in_flight},
      *links_, channels_, members_, *pool_, activity_, *calls_, *stats_, trace_.get(), owner);
  liveness_ = std::make_unique<internal::Liveness>(self_.name, self_.id, options_.heartbeat, *outbox_, *links_,
                                                   *calls_, members_, owner, lost);
  if (store_->has_leases()) {
    // Reported on the pool, like every other loss: the watch's thread never holds the agent.
    departures_ = std::make_unique<internal::DepartureWatch>(store_, self_.name, [this, lost](int id, absl::Status why) {
      (void)pool_->post([lost, id, why = std::move(why)] { lost(id, why); });
    });
  }
  if (options_.heartbeat.count() > 0) {
    calls_->set_heartbeat(options_.heartbeat, [this, owner](int peer) {
      if (std::shared_ptr<void> alive = owner.lock()) liveness_->suspect(peer, options_.heartbeat);
    });
  }
}

Agent::~Agent() {
  if (shut_down_.exchange(true)) return;
  if (!internal::on_agent_thread()) {
    shut_down_.store(false);
    shutdown();
    return;
  }
  // The last reference went on one of our own threads (a callback dropped it): that
  // thread cannot join itself, so a thread of its own tears down what is left. The
  // transport reaches us only through a weak reference, which no longer locks, and so
  // do the tasks of the objects of the stack.
  struct Remains {
    std::unique_ptr<Transport> transport;
    std::unique_ptr<CallTable> calls;
    std::shared_ptr<internal::ThreadPool> pool;
    std::shared_ptr<internal::Activity> activity;
  };
  auto remains = std::make_shared<Remains>(
      Remains{std::move(transport_), std::move(calls_), std::move(pool_), activity_});
  internal::run_on_reaper([remains] {
    if (remains->transport) remains->transport->close();
    if (remains->calls) {
      remains->calls->fail_all(absl::CancelledError("the agent was destroyed"));
      remains->calls->stop();
    }
    if (remains->pool) remains->pool->shutdown(kPoolShutdownDeadline);
  });
}

// ---- Membership.

uint64_t Agent::membership_version() const { return members_.snapshot()->version; }

absl::Status Agent::set_members(std::vector<PeerAddress> members) {
  int n = static_cast<int>(members.size());
  std::vector<WorkerInfo> infos;
  for (const PeerAddress& m : members) infos.push_back(m.info);
  FERRY_RETURN_IF_ERROR(members_.add(std::move(members)));
  group_size_.store(n);
  watch_records(infos);
  return absl::OkStatus();
}

absl::Status Agent::add_member(PeerAddress member) {
  WorkerInfo info = member.info;
  FERRY_RETURN_IF_ERROR(members_.add(std::move(member)));
  barrier_->forget(info.id);
  group_size_.fetch_add(1);
  watch_records({info});
  notify(std::move(info), MembershipChange::kJoined);
  return absl::OkStatus();
}

absl::Status Agent::remove_member(int id, MembershipChange why) {
  FERRY_ASSIGN_OR_RETURN(Member gone, members_.remove(id, why));
  if (departures_ != nullptr) departures_->remove(id);
  group_size_.fetch_sub(1);
  absl::Status status = absl::UnavailableError(absl::StrCat("worker \"", gone.info.name, "\" (id ", id, ") ",
                                                            why == MembershipChange::kLeft ? "left the group"
                                                                                           : "was lost"));
  calls_->fail_peer(id, status);
  links_->drop(id, /*left=*/why == MembershipChange::kLeft);
  // A leaver closes its own pipes once its calls are done; a lost one never will.
  if (why == MembershipChange::kLost) links_->close_incoming(id);
  barrier_->forget(id);
  notify(gone.info, why);
  return absl::OkStatus();
}

absl::Status Agent::retire_member(int id, std::chrono::milliseconds drain) {
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* m = table->find(id);
  if (m == nullptr) return table->absent(id);
  // It leaves on purpose: its record going with its process is no loss.
  if (departures_ != nullptr) departures_->remove(id);
  barrier_->retire(id, absl::UnavailableError(absl::StrCat("worker \"", m->info.name, "\" (id ", id,
                                                           ") left the group")));
  if (!calls_->wait_peer_idle(id, drain)) {
    FERRY_LOG(WARNING) << self_.name << ": calls to " << m->info.name << " still pending after " << drain.count()
                       << " ms; failing them as it leaves";
  }
  return remove_member(id, MembershipChange::kLeft);
}

void Agent::refuse_requests() {
  leaving_.store(true);
  server_->refuse_requests();
}

void Agent::set_control_handler(RequestHandler handler) { server_->set_control_handler(std::move(handler)); }

void Agent::set_join(std::function<absl::Status(std::chrono::milliseconds)> join) {
  Locked lock(hooks_mu_);
  join_ = std::make_shared<const std::function<absl::Status(std::chrono::milliseconds)>>(std::move(join));
}

void Agent::set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices) {
  channels_.set_device_maps(std::move(device_maps), std::move(reverse_device_maps), std::move(devices));
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

// ---- Calls.

std::optional<absl::Status> Agent::refuse_call() const {
  if (shut_down_.load(std::memory_order_relaxed)) return absl::CancelledError("the agent shut down");
  if (internal::serving_inline()) {
    return absl::FailedPreconditionError(absl::StrCat(
        self_.name, ": a function served inline made a call; inline functions run on the transport thread, "
                    "which must deliver that call's reply, so they must not make calls or block "
                    "(register the function to run on the worker pool instead)"));
  }
  return std::nullopt;
}

Future<Message> Agent::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  if (std::optional<absl::Status> refused = refuse_call()) return make_ready_future<Message>(*std::move(refused));
  return outbox_->send(to, std::move(message), timeout);
}

absl::StatusOr<Destination> Agent::resolve(std::string_view name) const { return outbox_->resolve(name); }

Future<Message> Agent::send(const Destination& to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  if (std::optional<absl::Status> refused = refuse_call()) return make_ready_future<Message>(*std::move(refused));
  return outbox_->send(to, std::move(message), timeout);
}

absl::Status Agent::ping_all(std::chrono::milliseconds timeout) {
  std::vector<Future<Message>> replies;
  for (const WorkerInfo& w : worker_infos()) replies.push_back(send(w.id, Message(MessageType::kPing, 0), timeout));
  for (const Future<Message>& reply : replies) FERRY_RETURN_IF_ERROR(reply.status());
  return absl::OkStatus();
}

void Agent::watch(int peer, bool watched) { liveness_->watch(peer, watched); }

// ---- The transport's events.

void Agent::on_accepted(const std::shared_ptr<Connection>& connection) { links_->accept(connection); }

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
      links_->count_refused();
      FERRY_LOG(WARNING) << self_.name << ": closing a connection from " << internal::describe(*s) << ": "
                         << small.message();
    }
    return small;
  }
  return check_message_size(metadata_bytes, tensor_bytes);
}

void Agent::on_message(const std::shared_ptr<Connection>& connection, Wire wire) {
  Session& s = *connection->session();
  if (s.stage != Stage::kOpen || (s.outgoing && internal::is_auth_message(wire.metadata))) {
    handshake(connection, wire);
    return;
  }
  if (!s.outgoing && internal::is_auth_message(wire.metadata)) {
    // Its opener retiring one of two connections between us (Links::settle); no
    // other such message comes once the handshake is over.
    if (!links_->on_retire(connection, wire)) {
      FERRY_LOG(WARNING) << self_.name << ": closing the connection from " << internal::describe(s)
                         << ": a handshake message after its handshake";
      connection->close();
    }
    return;
  }
  // Chunks land as they come, and the message naming them takes what landed, here on
  // the delivering thread: the connection's order guarantees they came first.
  if (is_notice(wire.metadata)) {
    if (!channels_.notice_awaits_descriptor(s.peer, wire)) {
      channels_.on_notice(s.peer, wire);
      return;
    }
    // On the pool: the notice may name a descriptor the peer passed on its other
    // connection, whose handshake this thread has yet to run (Channels::take_descriptor).
    const int peer = s.peer;
    auto handle = [this, owner = std::weak_ptr<void>(weak_from_this()), peer, wire = std::move(wire)] {
      if (std::shared_ptr<void> alive = owner.lock()) channels_.on_notice(peer, wire);
    };
    if (!pool_->post(handle)) handle();  // shutting down: here, so that nothing is kept
    return;
  }
  const bool chunk = is_chunk(wire.metadata);
  absl::Status chunked = chunk ? channels_.land_chunk(s.peer, std::move(wire)) : channels_.claim_chunked(s.peer, wire);
  if (!chunked.ok()) {
    FERRY_LOG(WARNING) << self_.name << ": closing the connection with " << internal::describe(s) << ": "
                       << chunked.message();
    connection->close();
    return;
  }
  if (chunk) return;
  if (s.outgoing) {
    if (is_request(wire.metadata)) {
      // The acceptor's own calls, on the connection we opened (carries_calls_to).
      if (!s.serves.load(std::memory_order_relaxed)) s.serves.store(true, std::memory_order_release);
      server_->on_request(connection, std::move(wire));
      return;
    }
  } else if (!s.shared.load(std::memory_order_acquire) || is_request(wire.metadata)) {
    server_->on_request(connection, std::move(wire));
    return;
  }
  // A reply to one of our calls, on our connection or on the peer's (a shared one).
  links_->take_reply(connection, wire);
  outbox_->on_reply(s.peer, std::move(wire));
}

void Agent::handshake(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  Session& s = *connection->session();
  HandshakeStep step =
      handshake_.step(s, wire, [this](int id, const std::string& name) { return check_claim(id, name); });
  switch (step.kind) {
    case HandshakeStep::Kind::kNone:
      return;
    case HandshakeStep::Kind::kSend:
      // With flush, the acceptor's challenge proved the token: the transport may share
      // with it what it keeps from strangers (Connection::authenticated).
      if (step.flush) connection->authenticated();
      connection->write(*std::move(step.reply));
      if (step.flush) {
        links_->flush(connection);
        links_->settle(s.peer);
      }
      return;
    case HandshakeStep::Kind::kAdmit:
      links_->admit(connection, /*replace=*/handshake_.uses_token());
      connection->authenticated();
      if (step.reply) connection->write(*std::move(step.reply));
      // Only behind the verdict may our own calls follow on it.
      links_->allow_sharing(*connection);
      links_->settle(s.peer);
      return;
    case HandshakeStep::Kind::kRefuse:
      links_->refuse(connection, step.why, step.tell);
      return;
    case HandshakeStep::Kind::kFail:
      if (links_->unlink(connection, std::move(step.reply))) on_peer_lost(s.peer, std::move(step.failure));
      return;
  }
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

void Agent::on_descriptor(const std::shared_ptr<Connection>& connection, uint64_t tag, int fd, std::string note) {
  links_->carried_descriptor(*connection);
  channels_.on_descriptor(connection, tag, fd, std::move(note));
}

void Agent::attach_channels() {
  internal::Channels::Core core;
  core.self_id = self_.id;
  core.peer_id = [this](std::string_view name) {
    const internal::Member* m = members_.snapshot()->find(name);
    return m == nullptr ? -1 : m->info.id;
  };
  core.pass_descriptor = [this](int peer, uint64_t tag, int fd, std::string_view note) -> absl::Status {
    std::shared_ptr<const Membership::Table> table = members_.snapshot();
    const internal::Member* m = table->find(peer);
    if (m == nullptr) {
      // A caller faster than this worker's set_members: its reply goes on the
      // connection it opened, and so does the descriptor.
      std::shared_ptr<Connection> theirs = links_->admitted(peer, "");
      if (theirs == nullptr) return absl::NotFoundError(absl::StrCat("worker id ", peer, " is not a member"));
      return theirs->pass_descriptor(tag, fd, note);
    }
    std::shared_ptr<Connection> connection = links_->descriptor_route(*m);
    if (connection == nullptr) {
      return absl::UnavailableError(absl::StrCat("no connection to worker \"", m->info.name, "\""));
    }
    return connection->pass_descriptor(tag, fd, note);
  };
  core.write = [this](int peer, Wire wire) {
    std::shared_ptr<const Membership::Table> table = members_.snapshot();
    if (const internal::Member* m = table->find(peer)) links_->send(*m, std::move(wire), 0);
  };
  channels_.attach(std::move(core));
}

void Agent::on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) {
  channels_.drop_descriptors(connection.get());
  Session* s = connection->session();
  if (s == nullptr) return;
  switch (links_->closed(connection, why)) {
    case Links::Loss::kNone:
      return;
    case Links::Loss::kLink:
      on_peer_lost(s->peer, internal::link_failure(*s, std::move(why)));
      return;
    case Links::Loss::kCaller:
      if (!shut_down_.load() && !leaving_.load()) {
        on_peer_lost(s->peer, absl::UnavailableError(absl::StrCat("worker \"", s->peer_name, "\" (id ", s->peer,
                                                                  ") is unreachable: its connection here ended: ",
                                                                  why.message())));
        return;
      }
      break;
    case Links::Loss::kOdd:
      break;
  }
  // The caller going away (kUnavailable) or our own close is routine; anything else
  // (a message too large, one that did not parse) is worth a line.
  if (!shut_down_.load() && why.code() != absl::StatusCode::kUnavailable &&
      why.code() != absl::StatusCode::kCancelled && s->stage != Stage::kRefused) {
    FERRY_LOG(WARNING) << self_.name << ": dropping connection from " << internal::describe(*s) << ": " << why;
  }
}

// ---- Lost peers.

void Agent::on_peer_lost(int peer, absl::Status why) {
  channels_.forget(peer);
  if (shut_down_.load()) {
    calls_->fail_peer(peer, absl::CancelledError("the agent shut down"));
    return;
  }
  // A lost peer that stopped (or whose host vanished) never closes its side of the
  // pipe it opened to us; that pipe would keep its id. One that left (join() saw it
  // arrive) closes its own.
  if (!barrier_->departing()) links_->close_incoming(peer);
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(peer);
  if (member == nullptr) {
    calls_->fail_peer(peer, why);
    return;
  }
  WorkerInfo info = member->info;
  // Once join() saw everyone arrive, the group is shutting down: peers going now left.
  const MembershipChange change = barrier_->departing() ? MembershipChange::kLeft : MembershipChange::kLost;
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
  // Recorded before the calls are failed: a call registered meanwhile sees it.
  const bool first = barrier_->record_loss(peer, why);
  calls_->fail_peer(peer, why);
  if (!first) return;
  // While a join round waits, the waiting thread accounts the loss in the store (most
  // such peers turn out to have left: they saw the round end first).
  if (std::optional<MembershipChange> tell = barrier_->decide(info)) notify(info, *tell);
}

std::string Agent::record_key(int id) const { return absl::StrCat(options_.store_prefix, "alive/", id); }

void Agent::watch_records(const std::vector<WorkerInfo>& workers) {
  if (departures_ == nullptr) return;
  for (const WorkerInfo& w : workers) {
    if (w.id != self_.id) departures_->add(w.id, w.name, record_key(w.id));
  }
}

// ---- Listeners.

void Agent::add_membership_listener(MembershipListener listener) {
  Locked lock(listeners_mu_);
  listeners_.push_back(std::move(listener));
}

void Agent::notify(WorkerInfo worker, MembershipChange change) {
  {
    Locked lock(changes_mu_);
    changes_.emplace_back(std::move(worker), change);
    if (delivering_) return;  // the task already running delivers this one too
    delivering_ = true;
  }
  bool posted = pool_->post([this, owner = std::weak_ptr<void>(weak_from_this())] {
    if (std::shared_ptr<void> alive = owner.lock()) deliver_changes();
  });
  if (!posted) {
    Locked lock(changes_mu_);
    changes_.clear();  // the pool has shut down: no listener runs any more
    delivering_ = false;
  }
}

void Agent::deliver_changes() {
  for (;;) {
    std::pair<WorkerInfo, MembershipChange> next;
    {
      Locked lock(changes_mu_);
      if (changes_.empty()) {
        delivering_ = false;
        return;
      }
      next = std::move(changes_.front());
      changes_.pop_front();
    }
    Locked lock(listeners_mu_);
    for (const MembershipListener& listener : listeners_) {
      internal::run_callback_guarded([&] { listener(next.first, next.second); });
    }
  }
}

// ---- join, sync, shutdown.

absl::Status Agent::sync(std::chrono::milliseconds timeout) {
  if (!activity_->wait_idle(timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(self_.name, ": ", calls_->pending(), " call(s) and ",
                                                    pool_->queued(), " queued task(s) still unfinished after ",
                                                    timeout.count(), " ms"));
  }
  return absl::OkStatus();
}

absl::Status Agent::join(std::chrono::milliseconds timeout) {
  // Leaving: the join round accounts for every member (probing those that never arrive),
  // and once it ends every member's record goes with its process; watching them now
  // would wake every worker once per departure.
  if (departures_) departures_->stop();
  std::shared_ptr<const std::function<absl::Status(std::chrono::milliseconds)>> custom;
  {
    Locked lock(hooks_mu_);
    custom = join_;
  }
  if (custom) {
    absl::Status left = (*custom)(timeout);
    // Only a worker that did leave says so: one whose leave was refused stays a member.
    if (left.ok() && metrics_) metrics_->retire(*store_);
    return left;
  }
  const Clock::time_point deadline = Clock::now() + timeout;
  // Every call is rooted in some worker's own unfinished work, so once each worker has
  // drained its own and arrived, the whole group is quiet.
  FERRY_RETURN_IF_ERROR(sync(timeout));
  const internal::JoinBarrier::Round round = barrier_->begin(group_size_.load());
  absl::Status waited = barrier_->wait(round, deadline, [this](int id) {
    if (options_.heartbeat.count() > 0) {
      liveness_->suspect(id, options_.heartbeat);
    } else {
      // Without heartbeats only a peer that refuses the connection is found.
      (void)send(id, Message(MessageType::kPing, 0), kProbeWithoutHeartbeat);
    }
  });
  for (auto& [worker, change] : barrier_->end_wait(round, waited)) notify(std::move(worker), change);
  FERRY_RETURN_IF_ERROR(waited);
  FERRY_ASSIGN_OR_RETURN(int64_t arrived, barrier_->arrived(round));
  // Before leaving: worker 0, which usually hosts the store, waits for every other
  // worker to leave before it goes.
  if (metrics_) metrics_->retire(*store_);
  return barrier_->leave(round, arrived, deadline);
}

void Agent::shutdown() {
  if (internal::on_agent_thread()) {
    // Tearing down joins this very thread: refuse rather than deadlock or abort.
    FERRY_LOG(ERROR) << self_.name
                     << ": shutdown() called from one of the agent's own threads (a user function or a future "
                        "callback); call it from a thread of your own";
    return;
  }
  if (shut_down_.exchange(true)) return;
  if (departures_) departures_->stop();
  if (outbox_) outbox_->stop();
  if (liveness_) liveness_->stop();
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
  info["requests_served"] = std::to_string(server_->served());
  info["num_worker_threads"] = std::to_string(pool_->size());
  info["queued_requests"] = std::to_string(pool_->queued());
  info["pool_wakeups"] = std::to_string(pool_->wakeups());
  info["auth"] = options_.auth_token.empty() ? "none" : "job token";
  links_->debug_info(info);
  channels_.debug_info(info);
  return info;
}

}  // namespace ferry
