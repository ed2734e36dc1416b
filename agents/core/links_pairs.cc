// Links: two connections to one peer (agents/core/links.h, settle()).
//
// Two workers that call each other for the first time at once each open a connection
// before the other's arrives, and each admits the other's. The higher id gives way:
//   1. settle() moves its link onto the peer's connection, under links_mu_, so that no
//      sender takes the old one afterwards (senders still writing to it are counted in
//      Session::writers);
//   2. retire() waits until nothing of ours is left to write on the old one, marks it
//      retiring and writes kRetire behind everything else on it;
//   3. the peer (on_retire) stops using it for anything of its own, and closes it once it
//      has written the reply to every request that came before the kRetire.
// Neither side reports the close as a loss. A connection that carried a descriptor is
// kept: one still in flight on it would be lost with it.
#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/core/call_table.h"
#include "agents/core/links.h"
#include "base/logging.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

// How often, and how many times, retire() looks again at a link that still has
// requests held back (max_requests_in_flight) or a sender mid-write.
constexpr std::chrono::milliseconds kRetireRetry{5};
constexpr int kMaxRetireTries = 200;

}  // namespace

void Links::settle(int peer) {
  // Only the higher id gives way, so that the two never both retire theirs.
  if (settings_.self_id <= peer) return;
  std::shared_ptr<Connection> old;
  std::string name;
  {
    Locked lock(links_mu_);
    auto it = links_.find(peer);
    if (it == links_.end()) return;
    Link& link = it->second;
    // Our own, with its handshake done and what waited for it written.
    if (!link.session->outgoing || link.connection == nullptr || link.address.empty() ||
        !link.session->open.load(std::memory_order_acquire)) {
      return;
    }
    name = link.session->peer_name;
    std::shared_ptr<Connection> theirs = share_incoming(PeerAddress{WorkerInfo{name, peer}, link.address});
    if (theirs == nullptr) return;
    old = std::move(link.connection);
    link.session = std::shared_ptr<Session>(theirs, theirs->session());
    link.connection = std::move(theirs);
    link.address.clear();
    link.reopens = 0;
    retiring_.emplace(old.get(), old);
  }
  pairs_settled_.fetch_add(1, std::memory_order_relaxed);
  FERRY_LOG(INFO) << self_name_ << ": worker \"" << name << "\" (id " << peer
                  << ") and this worker opened connections to each other at once; calls to it now go on the one it "
                     "opened, and this worker's is retired";
  retire(old, 0);
}

void Links::retire(const std::weak_ptr<Connection>& weak, int tries) {
  std::shared_ptr<Connection> old = weak.lock();
  if (old == nullptr) return;
  Session& s = *old->session();
  if (s.closed.load(std::memory_order_acquire)) return;
  // No sender can take this link any more (settle switched it under links_mu_), so
  // once those that had it are done, nothing of ours but replies it brings is written
  // to it: held requests go only as replies free room.
  bool idle = s.writers.load(std::memory_order_acquire) == 0;
  if (idle) {
    Locked lock(s.mu);
    idle = s.pending.empty() && s.held.empty();
  }
  if (!idle) {
    // Past the last try it stays, carrying what it holds to the end, as it did before.
    if (tries < kMaxRetireTries) {
      timer_.run_at(Clock::now() + kRetireRetry, [this, owner = owner_, weak, tries] {
        if (std::shared_ptr<void> alive = owner.lock()) retire(weak, tries + 1);
      });
    }
    return;
  }
  {
    Locked lock(s.flow_mu);
    if (s.descriptors > 0) return;
    s.retiring.store(true, std::memory_order_seq_cst);
  }
  old->write(auth_message(AuthKind::kRetire, {}));
}

bool Links::retired_closed(const std::shared_ptr<Connection>& connection, const absl::Status& why) {
  {
    Locked lock(links_mu_);
    if (retiring_.erase(connection.get()) == 0) return false;
  }
  // The peer closes a retired connection only once everything on it is answered, so a
  // call still waiting here ended with it (the peer died, or closed it for a backlog).
  Session& s = *connection->session();
  std::vector<uint64_t> unanswered;
  {
    Locked lock(s.mu);
    unanswered.assign(s.in_flight.begin(), s.in_flight.end());
    s.in_flight.clear();
    for (const Outgoing& o : s.held) {
      if (o.counted != 0) unanswered.push_back(o.counted);
    }
    s.held.clear();
  }
  for (uint64_t id : unanswered) {
    timer_.complete(id, absl::UnavailableError(absl::StrCat("worker \"", s.peer_name, "\" (id ", s.peer,
                                                            ") is unreachable: the connection this call went on "
                                                            "ended before its reply: ",
                                                            why.message())));
  }
  return true;
}

bool Links::carry_descriptor(Connection& connection) {
  Session* s = connection.published_session();
  if (s == nullptr) return true;
  Locked lock(s->flow_mu);
  if (s->retiring.load(std::memory_order_relaxed)) return false;
  ++s->descriptors;
  return true;
}

void Links::carried_descriptor(Connection& connection) {
  Session* s = connection.published_session();
  if (s == nullptr) return;
  Locked lock(s->flow_mu);
  ++s->descriptors;
}

bool Links::on_retire(const std::shared_ptr<Connection>& connection, const Wire& wire) {
  if (!parse_auth(wire, AuthKind::kRetire, 0)) return false;
  Session& s = *connection->session();
  {
    Locked lock(s.flow_mu);
    // Our own calls ride it, or a descriptor of ours went on it: it stays open (the
    // opener keeps it too, carrying nothing more of its own).
    if (s.shared.load(std::memory_order_acquire) || s.descriptors > 0 || s.retiring.load(std::memory_order_relaxed)) {
      return true;
    }
    s.retiring.store(true, std::memory_order_seq_cst);
  }
  {
    // No longer the peer's connection here: descriptors and shared calls take the one
    // this worker opened, and its close is nobody's loss.
    Locked lock(accepted_mu_);
    auto it = authenticated_.find(s.peer);
    if (it != authenticated_.end() && it->second.lock() == connection) authenticated_.erase(it);
  }
  retired_for_peers_.fetch_add(1, std::memory_order_relaxed);
  // Every request before the kRetire was taken already (one at a time, in order); the
  // last reply to one of them closes it if this does not.
  if (s.answering.load(std::memory_order_seq_cst) == 0 && !s.retired.exchange(true)) {
    connection->close_after_writes();
  }
  return true;
}

// Only a connection a peer opened is ever retired here: one this worker opened is not
// counted.
void Links::answering(Connection& connection) {
  Session& s = *connection.session();
  if (!s.outgoing) s.answering.fetch_add(1, std::memory_order_seq_cst);
}

void Links::reply_written(const std::shared_ptr<Connection>& connection) {
  Session& s = *connection->session();
  if (s.outgoing) return;
  if (s.answering.fetch_sub(1, std::memory_order_seq_cst) == 1 && s.retiring.load(std::memory_order_seq_cst) &&
      !s.retired.exchange(true)) {
    connection->close_after_writes();
  }
}

}  // namespace ferry::internal
