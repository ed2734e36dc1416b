// File: agents/core/links.h
//
// Links: the connections of one agent (agents/core/agent.h), below everything that
// uses them. It keeps
//   - this worker's links: the connection its calls to each peer go on, one it opened
//     (with the job-token hello of agents/core/handshake.h) or one the peer opened that
//     carries calls both ways (Connection::carries_calls_to);
//   - the connections peers opened: those still authenticating, at most
//     kMaxUnauthenticated of them, each for at most the handshake timeout, and the
//     authenticated ones by the id they proved;
//   - flow control: at most max_requests_in_flight requests out per link (the rest held
//     here, in order), and a peer's connection paused while it has that many served
//     here (with a kBusy every quarter heartbeat so that its caller's heartbeat hears us).
//
// It calls only what is below it (the transport, the call table's timer, the pure
// handshake) and reports upward through one callback: a peer found lost by a link whose
// acceptor never answered the hello. Everything else it decides, it returns.
//
// Threads: any thread; `lost` runs on the call table's timer thread. Locks: kLinks and
// kAccepted (agents/core/lock_order.h), and each connection's Session locks.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "agents/core/handshake.h"
#include "agents/core/lock_order.h"
#include "agents/core/membership.h"
#include "agents/core/session.h"
#include "agents/core/transport.h"

namespace ferry::internal {

class CallTable;

class Links {
 public:
  struct Settings {
    int self_id = -1;  // for settle's tie-break
    int max_requests_in_flight = 1024;
    std::chrono::milliseconds heartbeat{0};
    std::chrono::milliseconds handshake_timeout{0};
    // The backlog bound (AgentOptions::max_unsent_bytes, and max_requests_in_flight
    // messages), and how long a connection over it may go without its backlog falling
    // before it is closed (zero: never).
    size_t max_unsent_bytes = size_t{64} << 20;
    std::chrono::milliseconds unsent_deadline{0};
  };
  // `lost(peer, why)`: a link's acceptor sent no challenge within the handshake timeout.
  // `owner` keeps this object alive while a timer task runs (the agent that holds it).
  Links(std::string self_name, Transport& transport, CallTable& timer, const Handshake& handshake, Settings settings,
        std::weak_ptr<void> owner, std::function<void(int peer, absl::Status why)> lost);

  // ---- Sending.
  // Writes `wire` to `peer` on its link, opening the link (and its handshake) on first
  // use. `counted`: the call id of a kRequest, which waits for room under
  // max_requests_in_flight; 0 for anything else.
  void send(const PeerAddress& peer, Wire wire, uint64_t counted);
  // The connection messages to `peer` take now, opened (or shared) if there is none
  // yet; null if the link was dropped meanwhile. Its handshake may still be running.
  std::shared_ptr<Connection> connection_to(const PeerAddress& peer);
  // The connection a descriptor for `peer` goes on (Connection::pass_descriptor): one
  // whose handshake is done, so that the peer takes it as coming from this worker's
  // proven id whichever connection the message naming it takes. The one the peer
  // opened, once this worker admitted it (the peer's end opened before that), else
  // this worker's link if open (two workers that do not share a connection, in two
  // pid namespaces say, each call on their own), else connection_to's. Never one being
  // retired (settle); the one returned is never retired (carry_descriptor).
  std::shared_ptr<Connection> descriptor_route(const PeerAddress& peer);
  // The connection worker `peer` opened here, once admitted and while open (named
  // `name`, unless empty); null if none.
  std::shared_ptr<Connection> admitted(int peer, std::string_view name);
  // A reply to request `id` came on `connection`: its room goes to the next held one.
  void answered(const std::shared_ptr<Connection>& connection, uint64_t id);
  // A message on `connection` that is a reply to one of our calls: its room is freed
  // (answered) and its call id returned, read from the sealed header.
  uint64_t take_reply(const std::shared_ptr<Connection>& connection, const Wire& wire);
  // Lets the requests queued behind the handshake go, and later ones straight out.
  void flush(const std::shared_ptr<Connection>& connection);
  // Whether a connection carrying this worker's calls to `peer` is up.
  bool linked_to(int peer) const;
  // Takes `peer`'s link out of the table if it rides `connection`; whether it did.
  bool forget(int peer, const Connection* connection);
  // Takes `peer`'s link out and closes its connection. `left`: the peer left the group,
  // and a connection that carries its own calls too stays open for it to close.
  void drop(int peer, bool left = false);
  // A link of ours whose handshake failed: out of the table and closed, after `last`
  // when given (a refusal telling the peer why); whether it was still the peer's link
  // (then the peer is lost).
  bool unlink(const std::shared_ptr<Connection>& connection, std::optional<Wire> last = std::nullopt);

  // ---- Connections peers opened.
  // A new one: kept unauthenticated under the handshake deadline. When
  // kMaxUnauthenticated already wait, the oldest of them is closed to make room: an
  // idle holder of the slots, not the worker that connects next, is the one to go.
  void accept(const std::shared_ptr<Connection>& connection);
  // Refuses it: logs `why`, tells the peer `tell`, closes once that is written.
  void refuse(const std::shared_ptr<Connection>& connection, std::string_view why, std::string_view tell);
  // It proved the id in its session (or, without a token, claimed it): requests on it
  // are served from now on, and it speaks for that id here. `replace`: an older
  // connection of the id is closed, and this worker's calls it carried fail.
  void admit(const std::shared_ptr<Connection>& connection, bool replace);
  // From now on this worker's own calls to the opener may go on it.
  void allow_sharing(Connection& connection);
  // Closes the authenticated connection `peer` opened here, if any.
  void close_incoming(int peer);

  // ---- Two connections to one peer.
  // Two workers that open to each other at once each get a connection the other
  // admits; both would stay. The higher id gives way: once it holds both its own open
  // link to `peer` and the peer's connection (admitted, able to carry its calls), its
  // calls move to the peer's, and its own is retired: when nothing of ours is left to
  // write on it, a kRetire goes on it behind everything written there, and the peer
  // closes it once it has answered what came before. A connection that carried a
  // descriptor is kept. Called when a connection of `peer`'s is admitted and when this
  // worker's own link to it opens; does nothing for a lower id or a single connection.
  void settle(int peer);
  // One came on `connection`: counted the same.
  void carried_descriptor(Connection& connection);
  // An authentication-framed message on an open connection a peer opened: handles it if
  // it is the opener's kRetire (then true).
  bool on_retire(const std::shared_ptr<Connection>& connection, const Wire& wire);
  // The server took a request or control message from `connection` to answer, and
  // wrote its reply: a retired connection closes when nothing is left to answer.
  void answering(Connection& connection);
  void reply_written(const std::shared_ptr<Connection>& connection);

  // ---- Serving's flow control.
  // A request was taken from `connection`: whether there was room under the cap (if
  // not, it is not counted, and must be refused unrun); at the cap its reads pause.
  bool take_request(const std::shared_ptr<Connection>& connection);
  // One of its requests was answered: reads resume if they paused at the cap.
  void request_done(Connection& connection);
  // A message was taken from `connection` (on the thread delivering it): past the
  // backlog bound (Connection::unsent) its reads pause until the backlog falls to
  // half, and it is closed if the backlog does not fall for the deadline. One whose
  // reads never pause (it carries this worker's calls) is watched the same, and closed
  // at once past four times the bound's messages.
  void check_backlog(const std::shared_ptr<Connection>& connection);

  // ---- Ends.
  enum class Loss {
    kNone,    // routine, or reported already
    kLink,    // a connection carrying this worker's calls ended: the peer is lost
    kCaller,  // the authenticated connection of a peer we have no link to ended
    kOdd,     // nothing lost, but the reason is worth a line
  };
  Loss closed(const std::shared_ptr<Connection>& connection, const absl::Status& why);

  // Counters for debug_info, and "transports_by_peer": "b:ring,c:tcp".
  void debug_info(std::map<std::string, std::string>& info) const;
  // The metrics endpoint's series of which transport reaches each linked peer
  // (ferry_peer_transport{peer,transport} 1). The function may outlive this object;
  // any thread.
  std::function<std::string()> prometheus() const;
  uint64_t refused() const { return handshakes_refused_.load(std::memory_order_relaxed); }
  void count_refused() { handshakes_refused_.fetch_add(1, std::memory_order_relaxed); }

 private:
  struct Link {
    std::shared_ptr<Session> session;
    std::shared_ptr<Connection> connection;
    std::string address;  // where it was opened to, for a reopen
    int reopens = 0;
  };
  // The link to `peer`, made on its first use: on the peer's own connection when that
  // carries our calls too, else with a session this worker opens (`opens` set: the
  // caller calls open()).
  // `writing`: the caller writes to the link next, and then calls done_writing.
  Link link_to(const PeerAddress& peer, bool& opens, bool writing = false);
  static void done_writing(Session& s) { s.writers.fetch_sub(1, std::memory_order_acq_rel); }
  std::shared_ptr<Connection> share_incoming(const PeerAddress& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(links_mu_);
  void open(const PeerAddress& peer, std::shared_ptr<Session> session);
  void expect_challenge(const PeerAddress& peer, const std::shared_ptr<Session>& session);
  // A link of ours whose connection ended before the acceptor's challenge (so before any
  // request went out on it): whether a new connection will be opened for it, a little
  // later, with the same session and the requests waiting in it. An acceptor closes
  // such a connection when it makes room under kMaxUnauthenticated or has no room to
  // accept it; that is no loss of the peer. A peer that is gone fails the last try.
  bool reopen_later(const std::shared_ptr<Connection>& connection);
  void write_counted(const std::shared_ptr<Connection>& connection, Wire wire, uint64_t id);
  void pause(const std::shared_ptr<Connection>& connection);
  void keep_alive(const std::shared_ptr<Connection>& connection);
  // The timer's look at a backlogged connection, `tries` looks after it became so.
  void watch_backlog(const std::weak_ptr<Connection>& connection, int tries);
  void close_backlogged(const std::shared_ptr<Connection>& connection, Connection::Backlog backlog, std::string_view why);
  // A descriptor is about to go on `connection`: false if it is retiring (take another
  // route); else it is counted, and the connection is never retired.
  bool carry_descriptor(Connection& connection);
  // Sends the kRetire on `old` once nothing of ours is left to write on it, trying
  // again every few milliseconds up to a second (a burst of held requests); after that
  // it stays.
  void retire(const std::weak_ptr<Connection>& old, int tries);
  // An outgoing connection this worker retired (or was retiring) ended: out of
  // retiring_, and whatever it still carried failed. Whether it was one.
  bool retired_closed(const std::shared_ptr<Connection>& connection, const absl::Status& why);
  // Records, and logs at info level, the transport a new link to `peer` goes over.
  void note_route(const PeerAddress& peer);

  const std::string self_name_;
  Transport& transport_;
  CallTable& timer_;
  const Handshake& handshake_;
  const Settings settings_;
  const std::weak_ptr<void> owner_;
  const std::function<void(int, absl::Status)> lost_;

  // A link's session exists from the first send on; its connection is null while
  // connect() runs (outside the lock), and the sends meanwhile wait in the session, so
  // one peer never gets two connections from us.
  mutable RankedMutex links_mu_{LockRank::kLinks};
  absl::flat_hash_map<int, Link> links_ ABSL_GUARDED_BY(links_mu_);
  // This worker's connections that settle() took the calls off, until they close.
  absl::flat_hash_map<const Connection*, std::shared_ptr<Connection>> retiring_ ABSL_GUARDED_BY(links_mu_);
  // Each linked peer's name and the transport it is reached by, by id. A leaf lock;
  // shared with prometheus()'s function.
  struct Routes {
    absl::Mutex mu;
    std::map<int, std::pair<std::string, std::string>> by_peer ABSL_GUARDED_BY(mu);
  };
  const std::shared_ptr<Routes> routes_ = std::make_shared<Routes>();
  mutable RankedMutex accepted_mu_{LockRank::kAccepted};
  // Accepted connections still in their handshake, oldest first (at most
  // kMaxUnauthenticated + 1, so a linear erase is cheap).
  std::deque<std::pair<const Connection*, std::weak_ptr<Connection>>> unauthenticated_ ABSL_GUARDED_BY(accepted_mu_);
  // Takes `connection` out of unauthenticated_: whether it was there.
  bool authenticating_done(const Connection* connection) ABSL_EXCLUSIVE_LOCKS_REQUIRED(accepted_mu_);
  absl::flat_hash_map<int, std::weak_ptr<Connection>> authenticated_ ABSL_GUARDED_BY(accepted_mu_);

  std::atomic<uint64_t> handshakes_refused_{0};
  std::atomic<uint64_t> links_shared_{0};
  std::atomic<uint64_t> pairs_settled_{0};     // our connections retired for the peer's
  std::atomic<uint64_t> retired_for_peers_{0};  // peers' connections retired at their word
  std::atomic<uint64_t> reads_paused_{0};
  std::atomic<uint64_t> requests_refused_{0};
  std::atomic<uint64_t> backlog_pauses_{0};
  std::atomic<uint64_t> backlog_closed_{0};
  std::atomic<int> serving_peak_{0};
};

}  // namespace ferry::internal
