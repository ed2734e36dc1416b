// File: agents/core/session.h
//
// Session: what the agent core keeps for one connection (agents/core/transport.h):
// which way it goes, who is at the other end, where the job-token handshake stands
// (agents/core/handshake.h), and the requests that wait for it. Transports carry a
// Session without reading it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "agents/core/lock_order.h"
#include "agents/core/transport.h"

namespace ferry::internal {

enum class Stage : uint8_t {
  // A connection this worker opened:
  kHello,   // our hello is out; the acceptor's challenge comes next
  kProved,  // our proof is out and requests follow it; the acceptor's verdict comes next
  // A connection a peer opened:
  kAwaitHello,  // its hello comes next
  kAwaitProof,  // our challenge is out; its proof comes next
  // Either way:
  kOpen,     // requests and replies flow (authenticated, or no token in use)
  kRefused,  // refused or being closed: nothing more is read
};

// A message waiting to go out on a connection this worker opened. `counted`: the call
// id of a request counted under AgentOptions::max_requests_in_flight, else 0.
struct Outgoing {
  Wire wire;
  uint64_t counted = 0;
};

struct Session {
  Session(bool outgoing, int peer, std::string peer_name, Stage stage)
      : outgoing(outgoing), peer(peer), peer_name(std::move(peer_name)), stage(stage) {}

  const bool outgoing;
  // Outgoing: the member it goes to. Incoming: the id and name the opener proved with
  // the job token (-1 and "" without one, or until it has).
  int peer;
  std::string peer_name;

  // Written only by the events of this connection, which come one at a time (and, for
  // an outgoing one, before connect() returns, by the sender that opens it).
  Stage stage;
  std::string nonce_c;  // the opener's nonce
  std::string nonce_s;  // the acceptor's nonce
  bool acceptor_proved = false;
  // Why the acceptor refused us, to report when the connection then closes.
  std::string refusal;

  // Requests may go straight out (outgoing) or be served (incoming); read without a
  // lock on the hot path, set once under `mu` after `pending` went out.
  std::atomic<bool> open{false};
  // Outgoing: requests written while the handshake runs wait here, in order.
  RankedMutex mu{LockRank::kSession};
  std::vector<Outgoing> pending ABSL_GUARDED_BY(mu);
  // Outgoing: the requests (kRequest) written and not yet answered, by call id, and
  // those held back while as many are in flight as the peer takes
  // (AgentOptions::max_requests_in_flight): the caller, not the server, holds a flood.
  absl::flat_hash_set<uint64_t> in_flight ABSL_GUARDED_BY(mu);
  std::deque<Outgoing> held ABSL_GUARDED_BY(mu);
  // Incoming: the requests taken from this connection and not yet answered.
  std::atomic<int> serving{0};
  // Incoming: reads are paused (Connection::pause_reads) while `serving` is at
  // AgentOptions::max_requests_in_flight. Changed only under flow_mu; read without it
  // by a reply, which takes flow_mu only when it may have to resume.
  RankedMutex flow_mu{LockRank::kFlow};
  std::atomic<bool> reads_paused{false};
  bool keepalive_armed ABSL_GUARDED_BY(flow_mu) = false;  // a kBusy timer is set
  // More than AgentOptions::max_unsent_bytes (or max_requests_in_flight messages)
  // waits unsent on it (Connection::unsent): its reads stay paused, whatever `serving`
  // says, until the backlog falls to half; the call table's timer watches it meanwhile
  // (Links::check_backlog). The least backlog seen and when it last fell, for the
  // deadline.
  bool backlogged ABSL_GUARDED_BY(flow_mu) = false;
  Connection::Backlog backlog_least ABSL_GUARDED_BY(flow_mu);
  std::chrono::steady_clock::time_point backlog_fell ABSL_GUARDED_BY(flow_mu);
  // Incoming: `shareable` once the peer was told it is accepted (nothing of ours may
  // reach it before that verdict), `shared` once this worker's own calls to the peer
  // go on it too (Connection::carries_calls_to). A shared connection's reads are never
  // paused: the replies to our calls come on it. Both set under flow_mu.
  bool shareable ABSL_GUARDED_BY(flow_mu) = false;
  std::atomic<bool> shared{false};  // read without flow_mu
  // Outgoing: the peer's own calls came on it too (the peer shares it).
  std::atomic<bool> serves{false};
  // Two connections to one peer, each side having opened one at once (Links::settle):
  // the one the higher id opened is retired. Outgoing: `retiring` once this worker asked
  // the peer to retire it; incoming: once the opener asked and this worker agreed. Either
  // way nothing of this worker's goes on it any more. `descriptors`: passed or received
  // on it; a connection that carried one is kept, since one still in flight would be
  // lost with it. Both changed under flow_mu.
  std::atomic<bool> retiring{false};
  int descriptors ABSL_GUARDED_BY(flow_mu) = 0;
  // Outgoing: senders between taking this link from the table and writing to it.
  std::atomic<int> writers{0};
  // Incoming: requests and control messages taken from it whose reply is not written
  // yet, and whether it was closed once retired and answered.
  std::atomic<int> answering{0};
  std::atomic<bool> retired{false};
  // Set when the transport reported its end (under flow_mu, so that share_incoming
  // never shares a connection whose end was already handled as unshared); outgoing,
  // even before the core had it in its table (a connect that failed at once).
  std::atomic<bool> closed{false};
  absl::Status closed_why ABSL_GUARDED_BY(mu);
};

// "\"name\"" of the peer at the other end, or "an unnamed peer" before its hello.
std::string describe(const Session& s);
// Why the peer of a link of ours is lost when its connection ended for `why`: a plain
// close or failure (kUnavailable, kCancelled) becomes kUnavailable naming the peer.
absl::Status link_failure(const Session& s, absl::Status why);

}  // namespace ferry::internal
