// File: agents/core/transport.h
//
// The seam between the agent core (agents/core/agent.h) and a transport adapter. An
// adapter only moves bytes: it listens and hands back an address record to publish,
// opens a connection to a peer's record, writes messages on a connection in order,
// delivers what it reads, and reports the end of every connection. The core owns
// every protocol above that: call ids and deadlines, the job-token handshake,
// membership and its changes, heartbeats, device channels, shutdown.
//
//   class MyTransport final : public ferry::Transport { ... };     // agents/mine/
//   auto agent = ferry::Agent::start(self, store, options, handler,
//                                    std::make_unique<MyTransport>(...));
//
// docs/extending.md walks through adding one (agents/inproc/ is the worked example).
//
// Threads: a transport delivers events on threads of its own ("transport threads",
// marked with TransportThreadScope), or inline from connect() and write() when it has
// none. Events of one connection are delivered one at a time, in the order they
// happened; an event must not block. Methods may be called from any thread, and the
// core calls them holding none of its locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace ferry {

namespace internal {
struct Session;  // the core's state for one connection (agents/core/session.h)
}  // namespace internal

// One message as it crosses a transport: the sealed Message buffer, its tensors, and
// for each tensor what the receiver must do with it: "" for a CPU tensor, else what the
// device channel of that connection wrote there (agents/core/device_channel.h). A
// transport moves the tensors' bytes as they are and the targets as opaque strings.
struct Wire {
  std::string metadata;
  std::vector<Tensor> tensors;
  std::vector<std::string> targets;
};

// One connection: one this worker opened to a peer (its requests out, their replies
// in), or one a peer opened to us (its requests in, our replies out); on one that
// carries our calls to its opener too (carries_calls_to), both at once. Thread-safe.
// Owned by shared_ptr, by the transport while it is open and by the core.
class Connection {
 public:
  explicit Connection(std::shared_ptr<internal::Session> session = nullptr)
      : session_(std::move(session)), published_(session_.get()) {}
  virtual ~Connection() = default;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Queues `wire` behind the messages written before it; the tensors' storage is held
  // until the bytes are gone. A write that fails ends the connection (on_closed).
  // Writes after close() are dropped.
  virtual void write(Wire wire) = 0;
  // Closes the connection; on_closed follows unless close() came from the transport's
  // own close(). Idempotent.
  virtual void close() = 0;
  // Closes the connection once the messages written before have gone out (so that a
  // refusal's reason reaches the peer); on_closed follows as for close().
  virtual void close_after_writes() = 0;

  // Flow control for a connection a peer opened (its requests in, our replies out):
  // the core stops taking its requests while it serves as many as it allows
  // (AgentOptions::max_requests_in_flight), so a flood waits in the peer, the bytes
  // held back by the transport (a full socket buffer, a full ring), not in this
  // worker's memory.
  // - pause_reads(): the core calls it only from this connection's on_message, on the
  //   thread delivering it. No on_message of this connection follows until
  //   resume_reads(); what the transport has not read yet stays unread (a transport
  //   that must keep reading holds messages aside, and may check their headers).
  // - resume_reads(): any thread, at most once per pause_reads(). Delivery goes on, on
  //   a transport thread, never inline.
  // Neither blocks, writes, or calls back into the core: the core calls them holding a
  // lock of its own (the only calls it makes so). Writes on the connection go on while
  // it is paused, and so do reads on every other connection: requests and replies
  // must not share what a pause stops, or two workers calling each other would wait on
  // each other's replies. A transport whose one stream to a peer carries both ways
  // (agents/process_group/) holds that peer's requests aside while paused instead,
  // and keeps reading its replies. on_closed still comes when the connection ends.
  virtual void pause_reads() = 0;
  virtual void resume_reads() = 0;

  // What this side holds written and not yet gone: messages and their bytes (tensors
  // included) still queued, or handed on but still held for the peer (a transport
  // whose peer reads tensors in place counts those it holds for that; one that bounds
  // them by other means need not). "Gone" is as far as the transport can tell: taken
  // by the kernel, copied into the peer's ring, a write's completion reported. It is
  // how the core learns that a peer stops reading: it reads this after each request
  // it takes from a connection, pauses the connection's reads past its bound
  // (AgentOptions::max_unsent_bytes, and max_requests_in_flight messages), and reads
  // it again on the call table's timer until it falls to half the bound (then reads
  // resume) or it has not fallen for its deadline (then the connection is closed);
  // docs/hardening.md, "Backpressure". So it must be cheap (an atomic read, no
  // lock another thread holds while writing) and callable from any thread, holding
  // the core's locks; it never blocks or calls back. A transport that cannot tell
  // returns zeros (the default), and the core then never pauses for it.
  struct Backlog {
    uint64_t messages = 0;
    uint64_t bytes = 0;
  };
  virtual Backlog unsent() const { return {}; }

  // For a connection a peer opened: whether this worker's own calls to the worker
  // whose listen() record is `address` may go on it too, rather than on a second
  // connection (one per pair of workers halves what set-up, descriptors and teardown
  // cost). True only when the transport carries calls both ways and knows that worker
  // opened it (the ring: the kernel's pid of the opener is the record's), so that a
  // process claiming a member's name never gets the calls meant for it. The core then
  // never pauses its reads, since the replies to its own calls come on it: a request
  // past max_requests_in_flight on it is refused unrun. The core of the worker that
  // opened a connection serves whatever requests come on it.
  virtual bool carries_calls_to(const std::string& address) const {
    (void)address;
    return false;
  }

  // Passes a duplicate of the descriptor `fd` (borrowed; -1: none) with `note` (at most
  // kMaxDescriptorNote bytes) to the peer, which receives it before any message written
  // on this connection after this returns (TransportEvents::on_descriptor). A device
  // channel hands a CUDA pool to a peer on the same host so. Only a transport with a
  // Unix socket under it can; the others return kUnimplemented saying so.
  virtual absl::Status pass_descriptor(uint64_t tag, int fd, std::string_view note) {
    (void)tag, (void)fd, (void)note;
    return absl::UnimplementedError("this transport cannot pass file descriptors");
  }
  static constexpr size_t kMaxDescriptorNote = 8192;

  // The core found the peer at the other end to be a member: it proved the job token
  // (without a token in use: its handshake is done). Called once, on any thread,
  // holding none of the core's locks; it must not block or call back. A transport that
  // shares something with a peer only once the peer is known (the ring: the page that
  // wakes this worker, which every authenticated peer writes) hands it over here; what
  // the peer sends before that still arrives. The default does nothing.
  virtual void authenticated() {}

  // The core's state for this connection. A transport passes it to the constructor
  // (for connections it opens through connect()) and never reads it; the core sets it
  // on accepted connections in on_accepted, before any other event of theirs.
  internal::Session* session() const { return session_.get(); }
  void set_session(std::shared_ptr<internal::Session> session) {
    session_ = std::move(session);
    published_.store(session_.get(), std::memory_order_release);
  }
  // The same, for a thread that does not run this connection's events (one taking a
  // descriptor passed on it): null until the core set it.
  internal::Session* published_session() const { return published_.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<internal::Session> session_;
  std::atomic<internal::Session*> published_;
};

// What a transport tells the core. Implemented by the core; called on transport
// threads, never blocking.
class TransportEvents {
 public:
  virtual ~TransportEvents() = default;
  // A peer opened `connection` to us: its first event.
  virtual void on_accepted(const std::shared_ptr<Connection>& connection) = 0;
  // A message is coming, of `metadata_bytes` and tensors of `tensor_bytes`: OK to read
  // it, or why not, before anything is allocated for its tensors. On an error the
  // transport closes the connection and reports on_closed with that error.
  virtual absl::Status on_header(Connection& connection, uint64_t metadata_bytes,
                                 std::span<const uint64_t> tensor_bytes) = 0;
  // A message arrived whole.
  virtual void on_message(const std::shared_ptr<Connection>& connection, Wire wire) = 0;
  // The connection ended (the peer closed it, a read or write failed, or a connect
  // failed); its last event.
  virtual void on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) = 0;
  // The peer passed descriptor `fd` (owned by the callee from here on; -1: none) with
  // `tag` and `note` (Connection::pass_descriptor). Unlike the events above, it may come
  // on another transport thread, beside the connection's messages, and even before the
  // connection's handshake is done: the callee holds it for whoever asks by tag, in a
  // bounded store. The default closes it.
  virtual void on_descriptor(const std::shared_ptr<Connection>& connection, uint64_t tag, int fd, std::string note);
};

// Thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  // Starts listening, delivering events to `events` while it lives (a weak reference,
  // locked per event, so the core may go away on a transport thread). Returns the
  // address record peers need to reach this worker.
  virtual absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) = 0;
  // Opens a connection to worker `peer_name` at `address` (its listen() record). It
  // never fails here: writes queue until it is up, and a connection that cannot be made
  // ends in on_closed. `session` goes to the Connection's constructor.
  virtual std::shared_ptr<Connection> connect(std::shared_ptr<internal::Session> session,
                                              const std::string& peer_name, const std::string& address) = 0;
  // Whether connect() can reach the worker whose record is `address` (a transport made
  // of several asks each in turn; see agents/core/transport_set.h).
  virtual bool reaches(const std::string& address) const {
    (void)address;
    return true;
  }
  // Whether connect() reaches workers that were not there when this one started:
  // false for a fixed mesh (a process group), which cannot serve a dynamic group.
  virtual bool connects_on_demand() const { return true; }
  // Stops listening and closes every connection; when it returns, no event is being
  // delivered or will be. Idempotent. Not from a transport thread.
  virtual void close() = 0;
  // Counters and settings for debug_info(): "transports", "channels", "pipes", ...
  virtual std::map<std::string, std::string> debug_info() const = 0;
};

}  // namespace ferry
