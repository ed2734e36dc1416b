#include "agents/core/links.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "agents/core/call_table.h"
#include "agents/core/transport_set.h"
#include "base/logging.h"
#include "serialization/message.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

// A link whose connection an acceptor closed before its challenge is opened again this
// many times, the n-th after n times the delay (reopen_later).
constexpr int kMaxReopens = 2;
constexpr std::chrono::milliseconds kReopenDelay{50};

}  // namespace

std::string describe(const Session& s) {
  return s.peer_name.empty() ? std::string("an unnamed peer") : absl::StrCat("\"", s.peer_name, "\"");
}

absl::Status link_failure(const Session& s, absl::Status why) {
  if (why.code() == absl::StatusCode::kUnavailable || why.code() == absl::StatusCode::kCancelled) {
    return absl::UnavailableError(
        absl::StrCat("worker \"", s.peer_name, "\" (id ", s.peer, ") is unreachable: ", why.message()));
  }
  return why;
}

Links::Links(std::string self_name, Transport& transport, CallTable& timer, const Handshake& handshake,
             Settings settings, std::weak_ptr<void> owner, std::function<void(int, absl::Status)> lost)
    : self_name_(std::move(self_name)),
      transport_(transport),
      timer_(timer),
      handshake_(handshake),
      settings_(settings),
      owner_(std::move(owner)),
      lost_(std::move(lost)) {}

Links::Link Links::link_to(const PeerAddress& peer, bool& opens, bool writing) {
  Link link;
  bool created = false;
  {
    Locked lock(links_mu_);
    auto [it, inserted] = links_.try_emplace(peer.info.id);
    created = inserted;
    if (inserted) {
      if (std::shared_ptr<Connection> theirs = share_incoming(peer)) {
        // The peer's connection to us carries our calls to it too: no second one.
        it->second.session = std::shared_ptr<Session>(theirs, theirs->session());
        it->second.connection = std::move(theirs);
      } else {
        it->second.session = handshake_.opener(peer.info.id, peer.info.name);
        it->second.address = peer.address;
        opens = true;
      }
    }
    link = it->second;
    // Under the lock that settle() switches links under: a writer it must wait for is
    // counted before the switch.
    if (writing) link.session->writers.fetch_add(1, std::memory_order_acq_rel);
  }
  if (created) note_route(peer);
  return link;
}

void Links::send(const PeerAddress& peer, Wire wire, uint64_t counted) {
  bool opens = false;
  Link link = link_to(peer, opens, /*writing=*/true);
  Session& s = *link.session;
  struct Done {
    Session& s;
    ~Done() { done_writing(s); }
  } done{s};
  if (!s.open.load(std::memory_order_acquire)) {
    Locked lock(s.mu);
    if (!s.open.load(std::memory_order_relaxed)) {
      s.pending.push_back(Outgoing{std::move(wire), counted});
      if (!opens) return;
    }
  }
  if (opens) {
    open(peer, link.session);  // a copy: `done` still needs the session
    return;
  }
  if (link.connection == nullptr) {
    // Opened since we looked: the connection is in the table now.
    Locked lock(links_mu_);
    auto it = links_.find(peer.info.id);
    if (it == links_.end() || it->second.session != link.session) return;  // dropped meanwhile
    link.connection = it->second.connection;
  }
  if (counted != 0) {
    write_counted(link.connection, std::move(wire), counted);
  } else {
    link.connection->write(std::move(wire));
  }
}

std::shared_ptr<Connection> Links::connection_to(const PeerAddress& peer) {
  bool opens = false;
  Link link = link_to(peer, opens);
  if (opens) open(peer, link.session);
  if (link.connection != nullptr) return link.connection;
  Locked lock(links_mu_);
  auto it = links_.find(peer.info.id);
  if (it == links_.end() || it->second.session != link.session) return nullptr;
  return it->second.connection;
}

std::shared_ptr<Connection> Links::admitted(int peer, std::string_view name) {
  std::shared_ptr<Connection> theirs;
  {
    Locked lock(accepted_mu_);
    auto it = authenticated_.find(peer);
    if (it != authenticated_.end()) theirs = it->second.lock();
  }
  if (theirs == nullptr) return nullptr;
  const Session& s = *theirs->session();
  const bool up = s.open.load(std::memory_order_acquire) && !s.closed.load(std::memory_order_acquire);
  return up && (name.empty() || s.peer_name == name) ? theirs : nullptr;
}

std::shared_ptr<Connection> Links::descriptor_route(const PeerAddress& peer) {
  // Each candidate is counted as carrying a descriptor (never retired) unless it is
  // being retired already (settle), which makes it no route.
  std::shared_ptr<Connection> theirs = admitted(peer.info.id, peer.info.name);
  if (theirs != nullptr && carry_descriptor(*theirs)) return theirs;
  std::shared_ptr<Connection> ours;
  {
    Locked lock(links_mu_);
    auto it = links_.find(peer.info.id);
    if (it != links_.end() && it->second.connection != nullptr &&
        it->second.session->open.load(std::memory_order_acquire)) {
      ours = it->second.connection;
    }
  }
  if (ours == nullptr) ours = connection_to(peer);
  return ours != nullptr && carry_descriptor(*ours) ? ours : nullptr;
}

std::shared_ptr<Connection> Links::share_incoming(const PeerAddress& peer) {
  std::shared_ptr<Connection> connection;
  {
    Locked lock(accepted_mu_);
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
  Locked lock(s.flow_mu);
  // A paused connection would hold our replies back behind the peer's requests.
  if (!s.shareable || s.reads_paused.load(std::memory_order_seq_cst) || s.closed.load(std::memory_order_acquire) ||
      s.retiring.load(std::memory_order_acquire)) {
    return nullptr;
  }
  s.shared.store(true, std::memory_order_release);
  links_shared_.fetch_add(1, std::memory_order_relaxed);
  return connection;
}

void Links::allow_sharing(Connection& connection) {
  Session& s = *connection.session();
  Locked lock(s.flow_mu);
  s.shareable = true;
}

bool Links::forget(int peer, const Connection* connection) {
  Locked lock(links_mu_);
  auto it = links_.find(peer);
  if (it == links_.end() || it->second.connection.get() != connection) return false;
  links_.erase(it);
  return true;
}

bool Links::linked_to(int peer) const {
  Locked lock(links_mu_);
  auto it = links_.find(peer);
  return it != links_.end() && !it->second.session->closed.load(std::memory_order_acquire);
}

void Links::write_counted(const std::shared_ptr<Connection>& connection, Wire wire, uint64_t id) {
  Session& s = *connection->session();
  {
    Locked lock(s.mu);
    // Behind those already held, in order.
    if (!s.held.empty() || s.in_flight.size() >= static_cast<size_t>(settings_.max_requests_in_flight)) {
      s.held.push_back(Outgoing{std::move(wire), id});
      return;
    }
    s.in_flight.insert(id);
  }
  connection->write(std::move(wire));
}

uint64_t Links::take_reply(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  // Whole header: the caller took a message too short to tell for a request.
  uint64_t id;
  std::memcpy(&id, wire.metadata.data() + 8, sizeof(id));
  answered(connection, id);
  return id;
}

void Links::answered(const std::shared_ptr<Connection>& connection, uint64_t id) {
  Session& s = *connection->session();
  std::vector<Wire> go;
  {
    Locked lock(s.mu);
    if (s.in_flight.erase(id) == 0) return;
    while (!s.held.empty() && s.in_flight.size() < static_cast<size_t>(settings_.max_requests_in_flight)) {
      Outgoing next = std::move(s.held.front());
      s.held.pop_front();
      // A call that ended while held (timed out) is not sent at all; one that goes
      // carries the time its caller has left, not the time it had when it was made.
      std::optional<Clock::time_point> deadline = timer_.deadline_of(next.counted);
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

void Links::open(const PeerAddress& peer, std::shared_ptr<Session> session) {
  // The transport is called outside our locks: it may run its callbacks on this thread.
  std::shared_ptr<Connection> connection = transport_.connect(session, peer.info.name, peer.address);
  bool current;
  {
    Locked lock(links_mu_);
    auto it = links_.find(peer.info.id);
    current = it != links_.end() && it->second.session == session;
    if (current) it->second.connection = connection;
  }
  if (!current) {
    // Dropped while connecting (the peer was removed or lost): its calls failed already.
    connection->close();
    return;
  }
  // Read before the hello goes: the challenge it brings is handled on another thread.
  const bool no_token = session->stage == Stage::kOpen;
  connection->write(handshake_.hello(*session));
  if (no_token) {
    connection->authenticated();  // no token in use: nothing more will be proved
    flush(connection);
    settle(peer.info.id);
  } else {
    expect_challenge(peer, session);
  }
  if (session->closed.load(std::memory_order_acquire)) {
    // It ended before it was in the table (a peer we share no transport with): its
    // end was reported when forget() could not find it yet.
    absl::Status why;
    {
      Locked lock(session->mu);
      why = session->closed_why;
    }
    if (session->stage == Stage::kHello && why.code() == absl::StatusCode::kUnavailable && reopen_later(connection)) {
      return;
    }
    if (forget(peer.info.id, connection.get())) lost_(peer.info.id, link_failure(*session, std::move(why)));
  }
}

void Links::expect_challenge(const PeerAddress& peer, const std::shared_ptr<Session>& session) {
  // An acceptor that never answers (stopped, or not a ferry worker) would otherwise hold
  // the requests queued behind the handshake forever, those without a timeout too.
  // `open` turns on when its challenge came and our requests went; what happens after
  // that is the heartbeat's to judge.
  std::weak_ptr<Session> weak_session = session;
  const std::chrono::milliseconds limit = settings_.handshake_timeout;
  timer_.run_at(Clock::now() + limit,
                [this, owner = owner_, weak_session, id = peer.info.id, name = peer.info.name, limit] {
                  std::shared_ptr<void> alive = owner.lock();
                  std::shared_ptr<Session> s = weak_session.lock();
                  if (!alive || !s || s->open.load(std::memory_order_acquire)) return;
                  std::shared_ptr<Connection> connection;
                  {
                    Locked lock(links_mu_);
                    auto it = links_.find(id);
                    if (it == links_.end() || it->second.session != s) return;  // ended or replaced meanwhile
                    connection = std::move(it->second.connection);
                    links_.erase(it);
                  }
                  // Out of the table first, so the close reports nothing more.
                  if (connection != nullptr) connection->close();
                  lost_(id, absl::UnavailableError(absl::StrCat(
                                "worker \"", name, "\" (id ", id,
                                ") did not answer this worker's job-token hello within ", limit.count(),
                                " ms (handshake_timeout); is it stopped, or not a ferry worker?")));
                });
}

bool Links::reopen_later(const std::shared_ptr<Connection>& connection) {
  std::shared_ptr<Session> session;
  PeerAddress peer;
  int reopens = 0;
  {
    Locked lock(links_mu_);
    auto it = links_.find(connection->session()->peer);
    if (it == links_.end() || it->second.connection != connection || it->second.reopens >= kMaxReopens) return false;
    reopens = ++it->second.reopens;
    it->second.connection = nullptr;  // sends wait in the session meanwhile
    session = it->second.session;
    peer = PeerAddress{WorkerInfo{session->peer_name, session->peer}, it->second.address};
  }
  FERRY_LOG(INFO) << self_name_ << ": the connection to worker \"" << peer.info.name << "\" (id " << peer.info.id
                  << ") ended before its handshake; opening another (" << reopens << " of " << kMaxReopens << ")";
  timer_.run_at(Clock::now() + kReopenDelay * reopens, [this, owner = owner_, session, peer = std::move(peer)] {
    std::shared_ptr<void> alive = owner.lock();
    if (!alive) return;
    {
      Locked lock(links_mu_);
      auto it = links_.find(peer.info.id);
      if (it == links_.end() || it->second.session != session) return;  // dropped meanwhile: its calls failed
    }
    // The old connection ended and the new one does not exist yet: nothing else touches
    // the session's handshake state now.
    // (closed_why is set again by the next close.)
    handshake_.restart(*session);
    session->closed.store(false, std::memory_order_release);
    open(peer, session);
  });
  return true;
}

void Links::flush(const std::shared_ptr<Connection>& connection) {
  Session& s = *connection->session();
  for (;;) {
    std::vector<Outgoing> batch;
    {
      Locked lock(s.mu);
      if (s.pending.empty()) {
        s.open.store(true, std::memory_order_release);
        return;
      }
      batch.swap(s.pending);
    }
    for (Outgoing& o : batch) {
      if (o.counted != 0) {
        write_counted(connection, std::move(o.wire), o.counted);
      } else {
        connection->write(std::move(o.wire));
      }
    }
  }
}

void Links::note_route(const PeerAddress& peer) {
  // Outside links_mu_: the transport's debug_info takes its own locks.
  std::string via = transport_name_for(transport_, peer.address);
  FERRY_LOG(INFO) << self_name_ << ": calls to worker \"" << peer.info.name << "\" (id " << peer.info.id << ") go over "
                  << via;
  absl::MutexLock lock(&routes_->mu);
  routes_->by_peer[peer.info.id] = {peer.info.name, std::move(via)};
}

std::function<std::string()> Links::prometheus() const {
  return [routes = routes_] {
    auto label = [](const std::string& text) {
      std::string out;
      for (char c : text) {
        if (c == '"' || c == '\\') out.push_back('\\');
        out.push_back(c == '\n' ? ' ' : c);
      }
      return out;
    };
    absl::MutexLock lock(&routes->mu);
    if (routes->by_peer.empty()) return std::string();
    std::string out = "# TYPE ferry_peer_transport gauge\n";
    for (const auto& [id, route] : routes->by_peer) {
      absl::StrAppend(&out, "ferry_peer_transport{peer=\"", label(route.first), "\",transport=\"", label(route.second),
                      "\"} 1\n");
    }
    return out;
  };
}

void Links::drop(int peer, bool left) {
  {
    absl::MutexLock lock(&routes_->mu);
    routes_->by_peer.erase(peer);
  }
  std::shared_ptr<Connection> connection;
  std::vector<std::shared_ptr<Connection>> retiring;
  {
    Locked lock(links_mu_);
    for (auto it = retiring_.begin(); it != retiring_.end();) {
      if (it->second->session()->peer == peer) {
        retiring.push_back(std::move(it->second));
        retiring_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (const std::shared_ptr<Connection>& c : retiring) c->close();
  {
    Locked lock(links_mu_);
    auto it = links_.find(peer);
    if (it == links_.end()) return;
    connection = std::move(it->second.connection);
    links_.erase(it);
  }
  if (connection == nullptr) return;  // still connecting: open() closes it
  const Session& s = *connection->session();
  // A leaver's own calls may still be on it (the leave's last messages among them): it
  // closes the connection itself when it is done. Before, they had one of their own.
  if (left && (!s.outgoing || s.serves.load(std::memory_order_acquire))) return;
  // Out of the table, its late events report nothing (closed() checks the table).
  connection->close();
}

bool Links::unlink(const std::shared_ptr<Connection>& connection, std::optional<Wire> last) {
  Session& s = *connection->session();
  s.stage = Stage::kRefused;
  {
    Locked lock(links_mu_);
    auto it = links_.find(s.peer);
    if (it == links_.end() || it->second.connection != connection) return false;
    links_.erase(it);
  }
  if (last.has_value()) {
    connection->write(*std::move(last));
    connection->close_after_writes();
  } else {
    connection->close();
  }
  return true;
}

// ---- Connections peers opened.

bool Links::authenticating_done(const Connection* connection) {
  for (auto it = unauthenticated_.begin(); it != unauthenticated_.end(); ++it) {
    if (it->first == connection) {
      unauthenticated_.erase(it);
      return true;
    }
  }
  return false;
}

void Links::accept(const std::shared_ptr<Connection>& connection) {
  auto session = std::make_shared<Session>(false, -1, "", Stage::kAwaitHello);
  connection->set_session(session);
  std::shared_ptr<Connection> oldest;
  {
    Locked lock(accepted_mu_);
    unauthenticated_.emplace_back(connection.get(), connection);
    if (unauthenticated_.size() > static_cast<size_t>(kMaxUnauthenticated)) {
      oldest = unauthenticated_.front().second.lock();
      unauthenticated_.pop_front();
    }
  }
  if (oldest != nullptr) {
    FERRY_LOG(WARNING) << self_name_ << ": " << kMaxUnauthenticated
                       << " connections are waiting for their hello; closing the oldest, from "
                       << describe(*oldest->session());
    count_refused();
    oldest->close();
  }
  std::weak_ptr<Connection> weak_connection = connection;
  const std::chrono::milliseconds limit = settings_.handshake_timeout;
  timer_.run_at(Clock::now() + limit, [this, owner = owner_, weak_connection, limit] {
    std::shared_ptr<void> alive = owner.lock();
    std::shared_ptr<Connection> c = weak_connection.lock();
    if (!alive || !c || c->session()->open.load(std::memory_order_acquire)) return;
    bool waiting;
    {
      Locked lock(accepted_mu_);
      waiting = authenticating_done(c.get());
    }
    if (!waiting) return;
    FERRY_LOG(WARNING) << self_name_ << ": closing a connection from " << describe(*c->session())
                       << " that did not complete its hello within " << limit.count() << " ms";
    count_refused();
    c->close();
  });
}

void Links::refuse(const std::shared_ptr<Connection>& connection, std::string_view why, std::string_view tell) {
  Session& s = *connection->session();
  FERRY_LOG(WARNING) << self_name_ << ": refusing a pipe from " << describe(s) << ": " << why;
  count_refused();
  s.stage = Stage::kRefused;
  {
    Locked lock(accepted_mu_);
    authenticating_done(connection.get());
  }
  connection->write(auth_message(AuthKind::kRefused, {tell}));
  connection->close_after_writes();
}

void Links::admit(const std::shared_ptr<Connection>& connection, bool replace) {
  Session& s = *connection->session();
  std::shared_ptr<Connection> replaced;
  {
    Locked lock(accepted_mu_);
    authenticating_done(connection.get());
    auto [it, fresh] = authenticated_.try_emplace(s.peer, connection);
    if (!fresh) {
      // The newer of two connections claiming one id wins: a worker opens a second only
      // when it lost its first (a restarted process, a host that vanished without a
      // FIN), and the older one, still open here, is stale. Without a token the claim
      // only names the caller, and the older is left to end by itself.
      if (replace) replaced = it->second.lock();
      it->second = connection;
    }
  }
  if (replaced != nullptr) {
    FERRY_LOG(WARNING) << self_name_ << ": a new pipe from worker \"" << s.peer_name << "\" (id " << s.peer
                       << ") replaces its older one, which is closed (a restarted worker, or one whose old pipe "
                          "went stale)";
    // Out of the table already: its close reports no loss. Our calls that it carried
    // will not be answered by whoever now holds that id.
    if (forget(s.peer, replaced.get())) {
      timer_.fail_peer(s.peer, absl::UnavailableError(absl::StrCat(
                                   "worker \"", s.peer_name, "\" (id ", s.peer,
                                   ") replaced the connection this call went on (a restarted worker?)")));
    }
    replaced->close();
  }
  s.stage = Stage::kOpen;
  s.open.store(true, std::memory_order_release);
}

void Links::close_incoming(int peer) {
  std::shared_ptr<Connection> connection;
  {
    Locked lock(accepted_mu_);
    auto it = authenticated_.find(peer);
    if (it == authenticated_.end()) return;
    connection = it->second.lock();
    authenticated_.erase(it);
  }
  // Out of the table first (and out of the links, if our calls rode on it): its close
  // reports no second loss.
  if (connection != nullptr) {
    forget(peer, connection.get());
    connection->close();
  }
}

// ---- Ends.

Links::Loss Links::closed(const std::shared_ptr<Connection>& connection, const absl::Status& why) {
  Session* s = connection->session();
  {
    Locked lock(s->mu);
    s->closed_why = why;
  }
  bool shared;
  {
    // share_incoming reads `closed` under the same lock before it shares: either it
    // sees the end, or this sees the connection shared (and its link, inserted under
    // links_mu_ with it, once forget() takes that lock).
    Locked lock(s->flow_mu);
    s->closed.store(true, std::memory_order_release);
    shared = s->shared.load(std::memory_order_acquire);
  }
  if (s->outgoing) {
    if (retired_closed(connection, why)) return Loss::kNone;
    if (s->stage == Stage::kHello && why.code() == absl::StatusCode::kUnavailable && reopen_later(connection)) {
      return Loss::kNone;
    }
    // A connection already replaced or dropped reports nothing.
    return forget(s->peer, connection.get()) ? Loss::kLink : Loss::kNone;
  }
  bool current = false;  // the peer's one authenticated connection here
  {
    Locked lock(accepted_mu_);
    authenticating_done(connection.get());
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
  if (shared && forget(s->peer, connection.get())) return Loss::kLink;
  // A peer that only ever called us (an RRef holder calling its owner) is lost when its
  // connection goes: nothing else would tell. One we have a link to is judged by that
  // link, which fails too if the peer died. kCancelled is a close of ours (or a
  // connection the peer replaced), not a loss.
  if (current && s->stage == Stage::kOpen && why.code() != absl::StatusCode::kCancelled && !linked_to(s->peer)) {
    return Loss::kCaller;
  }
  // The caller going away (kUnavailable) or our own close is routine; anything else
  // (a message too large, one that did not parse) is worth a line.
  if (why.code() != absl::StatusCode::kUnavailable && why.code() != absl::StatusCode::kCancelled &&
      s->stage != Stage::kRefused) {
    return Loss::kOdd;
  }
  return Loss::kNone;
}

void Links::debug_info(std::map<std::string, std::string>& info) const {
  info["handshakes_refused"] = std::to_string(handshakes_refused_.load());
  info["reads_paused"] = std::to_string(reads_paused_.load());
  info["requests_refused_at_cap"] = std::to_string(requests_refused_.load());
  info["requests_in_flight_peak"] = std::to_string(serving_peak_.load());
  info["backlog_pauses"] = std::to_string(backlog_pauses_.load());
  info["backlog_closed"] = std::to_string(backlog_closed_.load());
  {
    absl::MutexLock lock(&routes_->mu);
    std::string routes;
    for (const auto& [id, route] : routes_->by_peer) {
      absl::StrAppend(&routes, routes.empty() ? "" : ",", route.first, ":", route.second);
    }
    info["transports_by_peer"] = routes;
  }
  {
    Locked lock(links_mu_);
    size_t on_theirs = 0;
    for (const auto& [id, link] : links_) on_theirs += link.session->outgoing ? 0 : 1;
    info["connections_out"] = std::to_string(links_.size() - on_theirs);
    // Links riding a connection the peer opened (Connection::carries_calls_to).
    info["connections_shared"] = std::to_string(on_theirs);
    info["connections_shared_total"] = std::to_string(links_shared_.load(std::memory_order_relaxed));
    info["connections_retiring"] = std::to_string(retiring_.size());
    info["pairs_settled"] = std::to_string(pairs_settled_.load(std::memory_order_relaxed));
    info["retired_for_peers"] = std::to_string(retired_for_peers_.load(std::memory_order_relaxed));
  }
  {
    Locked lock(accepted_mu_);
    size_t in = 0;
    for (const auto& [id, connection] : authenticated_) in += connection.expired() ? 0 : 1;
    info["connections_in"] = std::to_string(in);
  }
}

}  // namespace ferry::internal
