// Links' flow control (agents/core/links.h): the requests a peer may have served here
// at once, and what it leaves unread.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "agents/core/call_table.h"
#include "agents/core/links.h"
#include "base/logging.h"
#include "serialization/message.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// ---- Serving's flow control.

bool Links::take_request(const std::shared_ptr<Connection>& connection) {
  Session& s = *connection->session();
  const int cap = settings_.max_requests_in_flight;
  const int serving = s.serving.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (serving > cap) {
    // Reads stop at the cap (below), so only a transport that delivers past a pause
    // gets here; the last line of defence still queues nothing.
    s.serving.fetch_sub(1, std::memory_order_seq_cst);
    requests_refused_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  int peak = serving_peak_.load(std::memory_order_relaxed);
  while (serving > peak && !serving_peak_.compare_exchange_weak(peak, serving, std::memory_order_relaxed)) {
  }
  // A caller with a larger cap, or one that is not ferry, then waits in its own
  // transport rather than in this worker's memory.
  if (serving >= cap) pause(connection);
  return true;
}

void Links::pause(const std::shared_ptr<Connection>& connection) {
  Session& s = *connection->session();
  bool keepalive = false;
  {
    Locked lock(s.flow_mu);
    // A connection carrying calls both ways is never paused: the replies to this
    // worker's own calls would wait behind it. Requests past the cap are refused.
    if (s.outgoing || s.shared.load(std::memory_order_acquire)) return;
    if (s.reads_paused.load(std::memory_order_seq_cst)) return;  // paused for its backlog
    // The flag goes up before the count is read again, and a reply lowers the count
    // before it reads the flag: one of the two sees the other, so a reply that came
    // meanwhile never leaves the connection paused with room under the cap.
    s.reads_paused.store(true, std::memory_order_seq_cst);
    if (s.serving.load(std::memory_order_seq_cst) < settings_.max_requests_in_flight && !s.backlogged) {
      s.reads_paused.store(false, std::memory_order_seq_cst);
      return;
    }
    connection->pause_reads();
    reads_paused_.fetch_add(1, std::memory_order_relaxed);
    keepalive = settings_.heartbeat.count() > 0 && !s.keepalive_armed;
    if (keepalive) s.keepalive_armed = true;
  }
  if (keepalive) keep_alive(connection);
}

void Links::request_done(Connection& connection) {
  Session& s = *connection.session();
  s.serving.fetch_sub(1, std::memory_order_seq_cst);
  if (!s.reads_paused.load(std::memory_order_seq_cst)) return;
  Locked lock(s.flow_mu);
  if (!s.reads_paused.load(std::memory_order_seq_cst) ||
      s.serving.load(std::memory_order_seq_cst) >= settings_.max_requests_in_flight || s.backlogged) {
    return;
  }
  s.reads_paused.store(false, std::memory_order_seq_cst);
  connection.resume_reads();
}

// ---- Backlogs: what a peer leaves unread.

namespace {

bool over(const Connection::Backlog& b, size_t bytes, int messages) {
  return b.bytes > bytes || b.messages > static_cast<uint64_t>(messages);
}

}  // namespace

void Links::check_backlog(const std::shared_ptr<Connection>& connection) {
  const Connection::Backlog backlog = connection->unsent();
  const int cap = settings_.max_requests_in_flight;
  if (!over(backlog, settings_.max_unsent_bytes, cap)) return;
  Session& s = *connection->session();
  bool watch = false;
  bool keepalive = false;
  bool too_much = false;
  {
    Locked lock(s.flow_mu);
    if (s.closed.load(std::memory_order_acquire)) return;
    if (!s.backlogged) {
      s.backlogged = true;
      s.backlog_least = backlog;
      s.backlog_fell = Clock::now();
      watch = true;
    }
    if (!s.outgoing && !s.shared.load(std::memory_order_acquire)) {
      if (!s.reads_paused.load(std::memory_order_seq_cst)) {
        s.reads_paused.store(true, std::memory_order_seq_cst);
        connection->pause_reads();
        backlog_pauses_.fetch_add(1, std::memory_order_relaxed);
        keepalive = settings_.heartbeat.count() > 0 && !s.keepalive_armed;
        if (keepalive) s.keepalive_armed = true;
      }
    } else {
      // Its requests cannot be stopped, and a ferry caller sends at most its cap: a peer
      // that sent past it while reading nothing is closed before it costs more.
      too_much = backlog.messages > 4 * static_cast<uint64_t>(cap);
    }
  }
  if (too_much) {
    close_backlogged(connection, backlog, "the peer keeps sending requests past max_requests_in_flight");
    return;
  }
  if (keepalive) keep_alive(connection);
  if (watch) watch_backlog(connection, 0);
}

void Links::watch_backlog(const std::weak_ptr<Connection>& connection, int tries) {
  // Soon at first, so that a caller that reads again is served again at once; then
  // less often while the backlog stays.
  const auto wait = std::chrono::milliseconds(1 << std::min(tries, 4));
  timer_.run_at(Clock::now() + wait, [this, owner = owner_, connection, tries] {
    std::shared_ptr<void> alive = owner.lock();
    std::shared_ptr<Connection> c = connection.lock();
    if (!alive || !c) return;
    const Connection::Backlog backlog = c->unsent();
    Session& s = *c->session();
    bool expired = false;
    {
      Locked lock(s.flow_mu);
      if (s.closed.load(std::memory_order_acquire)) {
        s.backlogged = false;
        return;
      }
      if (!over(backlog, settings_.max_unsent_bytes / 2, settings_.max_requests_in_flight / 2)) {
        s.backlogged = false;
        if (s.reads_paused.load(std::memory_order_seq_cst) &&
            s.serving.load(std::memory_order_seq_cst) < settings_.max_requests_in_flight) {
          s.reads_paused.store(false, std::memory_order_seq_cst);
          c->resume_reads();
        }
        return;
      }
      if (backlog.bytes < s.backlog_least.bytes || backlog.messages < s.backlog_least.messages) {
        s.backlog_least.bytes = std::min(s.backlog_least.bytes, backlog.bytes);
        s.backlog_least.messages = std::min(s.backlog_least.messages, backlog.messages);
        s.backlog_fell = Clock::now();
      }
      expired = settings_.unsent_deadline.count() > 0 && Clock::now() - s.backlog_fell >= settings_.unsent_deadline;
    }
    if (expired) {
      close_backlogged(c, backlog,
                       absl::StrCat("none of it left for ", settings_.unsent_deadline.count(),
                                    " ms: the peer is not reading"));
      return;
    }
    watch_backlog(c, tries + 1);
  });
}

void Links::close_backlogged(const std::shared_ptr<Connection>& connection, Connection::Backlog backlog,
                             std::string_view why) {
  FERRY_LOG(WARNING) << self_name_ << ": closing the connection with " << describe(*connection->session()) << ": "
                     << backlog.messages << " messages (" << backlog.bytes << " bytes) written to it wait unsent, "
                     << why;
  backlog_closed_.fetch_add(1, std::memory_order_relaxed);
  connection->close();
}

void Links::keep_alive(const std::shared_ptr<Connection>& connection) {
  std::weak_ptr<Connection> weak_connection = connection;
  timer_.run_at(Clock::now() + std::max(settings_.heartbeat / 4, std::chrono::milliseconds(1)),
                [this, owner = owner_, weak_connection] {
                  std::shared_ptr<void> alive = owner.lock();
                  std::shared_ptr<Connection> c = weak_connection.lock();
                  if (!alive || !c) return;
                  Session& s = *c->session();
                  {
                    Locked lock(s.flow_mu);
                    if (!s.reads_paused.load(std::memory_order_seq_cst)) {
                      s.keepalive_armed = false;
                      return;
                    }
                  }
                  c->write(Wire{Message(MessageType::kBusy, 0).seal(), {}, {}});
                  keep_alive(c);
                });
}

}  // namespace ferry::internal
