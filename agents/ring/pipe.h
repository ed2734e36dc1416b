// File: agents/ring/pipe.h (not installed)
//
// Pipe: one ring connection, either way, as the agent core sees it (a Connection of
// agents/core/transport.h). It writes messages into its outgoing ring on the caller's
// thread, or queues what does not fit for the data thread to finish (pump()), and
// reads whole messages out of its incoming ring on whichever thread steps the endpoint
// (receive(), agents/ring/endpoint.h), delivering them there; tensors sent by address
// are read by the endpoint's reader threads meanwhile (agents/ring/read_pool.h).
//
// Ownership: the endpoint's data thread holds every live pipe (shared) until it is
// reported closed; the core holds the pipes it was handed; a pipe holds its endpoint
// only weakly, and owns its socket, its mapping of the segment and a share of its
// peer's bell.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "agents/core/transport.h"
#include "agents/ring/protocol.h"
#include "agents/ring/read_pool.h"
#include "agents/ring/ring.h"
#include "agents/ring/unix_socket.h"

namespace ferry::internal::ring {

struct Endpoint;

// The token that Pipe::attach takes for the segment `segment_fd`: under TSan, shared by
// every mapping of that segment in this process; elsewhere nullptr.
void* sync_token(int segment_fd);

// One message on its way into a ring; advance() copies what fits.
struct Outgoing {
  std::string head;  // the fixed part, the entries and the targets
  std::string metadata;
  std::vector<Tensor> tensors;  // those whose bytes go through the ring
  uint64_t bytes = 0;           // all of the above, for Pipe::unsent()
  size_t part = 0;
  uint64_t offset = 0;

  // Copies up to `free` bytes into `tx` (and takes them off `free`); true once the
  // whole message is in.
  bool advance(ring::Producer& tx, uint64_t& free);
};

// One connection, either way. Thread safety: write(), close(), close_after_writes(),
// pause_reads() and resume_reads() may come from any thread; pump(), receive() and
// end() run on the thread that steps the endpoint (one at a time); the rest is set
// before the pipe is shared, or by the control thread as each comment says.
class Pipe final : public Connection, public std::enable_shared_from_this<Pipe> {
 public:
  Pipe(std::shared_ptr<Session> session, std::weak_ptr<Endpoint> home, int side)
      : Connection(std::move(session)), home_(std::move(home)), side_(side) {}

  ~Pipe() override;

  // Before the pipe is shared: the socket (owned from here on) and the segment.
  // `token`: sync_token() of the segment.
  void attach(int fd, Mapping segment, uint64_t ring_bytes, void* token);
  bool attached() const { return shared_ != nullptr; }

  // Acceptor before the pipe is shared, connector on the reply (control thread): the
  // peer's process as the kernel reports it (acceptor), and its bit in the peer's news.
  void name_peer_slot(uint32_t peer_slot) { peer_slot_.store(peer_slot, std::memory_order_relaxed); }
  void set_peer_pid(pid_t pid) { peer_pid_.store(pid, std::memory_order_relaxed); }
  // Connector, control thread: the acceptor's reply came (once).
  bool replied() const { return replied_; }
  void set_replied() { replied_ = true; }
  // Control thread: the peer's bell came (kBell, once its core authenticated this
  // worker) and is mapped; from now on writes ring it and set the peer's slot in its
  // news (what was written before is announced here). Until then a write wakes the
  // peer over the socket (kWake).
  void meet(std::shared_ptr<const Mapping> bell);
  bool met() const { return peer_bell_.load(std::memory_order_acquire) != nullptr; }
  // The core authenticated the peer: it gets this worker's bell (a kBell packet). A
  // socket that cannot take the packet ends the connection.
  void authenticated() override;
  // Control thread: the peer says it wrote (kWake). Rings this worker's own bell for
  // this pipe; on an accepted pipe whose peer is not authenticated yet, at most
  // kMaxUnauthenticatedWakes times (the data thread still reads every ring each
  // kReadAllEvery).
  void on_wake(Endpoint& home);
  static constexpr uint32_t kMaxUnauthenticatedWakes = 256;
  bool accepted() const { return side_ == 1; }
  // Acceptor, before the pipe is shared: whether the core may send its own calls on it
  // (RingOptions::two_way). Each direction has its own ring, so either side's calls
  // and replies flow however busy the other is.
  void set_two_way(bool yes) { two_way_ = yes; }
  // The opener must be the process the record names, as the kernel reports the
  // socket's other end (a process that only claims a member's name gets none of the
  // calls meant for it).
  bool carries_calls_to(const std::string& address) const override;
  // Connector, before the pipe is shared: the pid the peer's record names (its reply
  // must say the same), and the listener's pid as the kernel sees it, which what the
  // peer writes in place is read from, even before its reply is here: the hello told
  // it whether this worker can.
  void name_peer(pid_t named, pid_t seen) {
    named_pid_ = named;
    peer_pid_.store(seen, std::memory_order_relaxed);
  }
  pid_t named_pid() const { return named_pid_; }
  // Before the pipe is shared: a pidfd of the peer's process (socket_peer_pidfd, owned
  // from here on; -1: none), and whether this side told the peer it reads it in place
  // (its probe was read from that process). A tensor by address from a peer told no is
  // refused unread; one read in place from a process that has since exited (its pid
  // then perhaps another's) is discarded, and either ends the connection.
  void set_peer_process(int pidfd, bool reads_peer) {
    peer_pidfd_ = pidfd;
    reads_peer_ = reads_peer;
  }
  pid_t peer_pid() const { return peer_pid_.load(std::memory_order_relaxed); }
  void set_peer_reads_me(bool yes) { peer_reads_me_.store(yes, std::memory_order_release); }
  bool peer_reads_me() const { return peer_reads_me_.load(std::memory_order_acquire); }

  void write(Wire wire) override;
  void close() override;
  // Over the connection's Unix socket (a kDescriptor packet), which the peer's control
  // thread reads: it arrives before whatever this side writes on the rings afterwards
  // is read, since the peer's core asks for it only on a message written after it.
  absl::Status pass_descriptor(uint64_t tag, int fd, std::string_view note) override;

  // A paused pipe's ring is not read: it fills, and the peer's writes wait in its own
  // queue (Outgoing) for room, as for any slow reader. Only the requests' ring stops;
  // our replies go out through the other. Pauses come between messages (from
  // on_message), so a paused receive() never stops inside one.
  void pause_reads() override { paused_.store(true, std::memory_order_seq_cst); }
  void resume_reads() override;
  bool paused() const { return paused_.load(std::memory_order_seq_cst); }

  void close_after_writes() override;

  // The messages waiting in the queue for room in the ring, and their bytes. Tensors
  // held for the peer to read in place are not counted: RingOptions::max_held_bytes
  // bounds them.
  Backlog unsent() const override {
    return Backlog{unsent_messages_.load(std::memory_order_relaxed), unsent_bytes_.load(std::memory_order_relaxed)};
  }

  // Data thread: continues writes that did not fit. True when it moved something.
  bool pump() {
    if (!tx_pending_.load(std::memory_order_acquire)) return false;
    bool close_now;
    bool moved;
    {
      std::lock_guard<std::mutex> lock(tx_mu_);
      uint64_t before = queue_.size();
      moved_ = false;
      close_now = pump_locked();
      moved = moved_ || queue_.size() != before;
    }
    if (close_now) close();
    return moved;
  }

  // Bytes this side has taken off the peer's ring, and that ring's size.
  uint64_t received_bytes() const { return rx_.taken(); }
  uint64_t ring_bytes() const { return rx_.capacity(); }
  bool has_work() const { return (!paused() && rx_.has_data()) || tx_pending_.load(std::memory_order_relaxed); }

  // Data thread: reads what the ring holds, delivering whole messages. True when it
  // took something. A message with tensors sent by address is handed to the
  // endpoint's reader threads once its ring bytes are in, and the pipe reads no
  // further (its messages stay in order) until a later call finds the reads done and
  // delivers it, or finds them stalled past the timeout and ends the connection.
  bool receive(Endpoint& home, const std::shared_ptr<TransportEvents>& events);
  // Under step_mu: whether the message being read in place has its reads finished,
  // or stalled for longer than `timeout`.
  bool reads_due(std::chrono::milliseconds timeout) const {
    return job_ != nullptr && (job_->finished.load(std::memory_order_acquire) || job_->stalled(timeout));
  }

  // No more reading or writing: the peer is told we let go of what it may read in
  // place, then that memory is released. Data thread or after it stopped.
  void let_go();

  // Has the data thread end the connection with `why` (after delivering what the ring
  // still holds); once, whoever finds the end first.
  void end(Endpoint& home, absl::Status why);

  // This pipe's bit in its own endpoint's news, chosen before the pipe is shared.
  uint32_t own_slot = ring::kNoSlot;
  std::atomic<bool> reported{false};
  std::atomic<bool> ending{false};  // a kGone is posted
  std::atomic<bool> broken{false};  // the ring cannot be read any further

 private:
  // Under tx_mu_. Writes what fits and wakes the peer; true when the pipe should now
  // close (close_after_writes() and the queue drained).
  bool pump_locked();
  void publish_locked();
  bool fail_locked(const char* why);
  // Under tx_mu_: unsent()'s copy of the queue's size.
  void count_unsent_locked();
  // Under tx_mu_: the tensors held for the message `seq` are let go (acknowledged, or
  // the connection ends); counts them out.
  void drop_held_locked(const std::vector<Tensor>& tensors);

  // Gives the bytes read back to the peer, waking it if it waits for room.
  void release_read();
  // Tells the peer there is something for it: its bell, or before it came, a kWake.
  void wake_peer();

  // The receive side's state between calls: which part of a frame comes next.
  enum class Stage { kFixed, kEntries, kTargets, kMetadata, kTensors, kReading };
  bool take_into(std::string& buffer, size_t need, uint64_t& avail);
  // The core's verdict on the message whose entries were read (on_header).
  absl::Status check_header(TransportEvents& events);
  // Makes the message's wire: its targets, metadata and tensor buffers.
  absl::Status admit(Endpoint& home);
  // Hands the current message's tensors sent by address to the reader threads.
  void start_reads(Endpoint& home);
  // Once they are done: whether the message may be delivered (its reads succeeded and
  // the peer still holds what was read), else why not; acknowledges it to the peer.
  absl::Status finish_reads(Endpoint& home);

  const std::weak_ptr<Endpoint> home_;
  const int side_;  // 0: opened by this worker (the connector), 1: accepted
  bool two_way_ = false;  // set before the pipe is shared
  int fd_ = -1;
  Mapping segment_;
  ring::SegmentHeader* shared_ = nullptr;
  std::shared_ptr<const Mapping> peer_bell_map_;  // shared with the peer's other pipes
  std::atomic<ring::Bell*> peer_bell_{nullptr};
  std::atomic<pid_t> peer_pid_{0};
  pid_t named_pid_ = 0;             // connector: set before the pipe is shared
  int peer_pidfd_ = -1;             // set before the pipe is shared
  bool reads_peer_ = false;         // set before the pipe is shared
  std::atomic<uint32_t> peer_slot_{ring::kNoSlot};  // set before the peer's bell comes
  void* tsan_token_ = nullptr;  // set before the pipe is shared
  std::atomic<bool> peer_reads_me_{false};
  std::atomic<bool> authenticated_{false};  // this worker's bell went to the peer
  bool replied_ = false;                    // control thread only
  uint32_t unauthenticated_wakes_ = 0;      // control thread only
  std::atomic<bool> writable_{true};
  std::atomic<bool> closing_{false};
  std::atomic<bool> paused_{false};

  std::mutex tx_mu_;
  ring::Producer tx_;                              // guarded by tx_mu_
  std::deque<Outgoing> queue_;                     // guarded by tx_mu_
  std::map<uint64_t, std::vector<Tensor>> held_;   // guarded by tx_mu_: read in place, not acked
  uint64_t next_seq_ = 1;                          // guarded by tx_mu_
  uint64_t queued_bytes_ = 0;                      // guarded by tx_mu_
  std::atomic<uint64_t> held_bytes_{0};            // written under tx_mu_: the tensors in held_
  std::atomic<uint64_t> unsent_messages_{0};       // written under tx_mu_
  std::atomic<uint64_t> unsent_bytes_{0};          // written under tx_mu_
  bool close_when_written_ = false;                // guarded by tx_mu_
  bool moved_ = false;                             // guarded by tx_mu_
  std::atomic<bool> tx_pending_{false};

  // Data thread only.
  ring::Consumer rx_;
  Stage stage_ = Stage::kFixed;
  std::string scratch_;
  Fixed fixed_{};
  std::vector<Entry> entries_;
  Wire wire_;
  size_t tensor_ = 0;
  uint64_t offset_ = 0;
  bool any_in_place_ = false;
  std::shared_ptr<ReadJob> job_;  // the current message's in-place reads (kReading)
};

}  // namespace ferry::internal::ring
