// File: agents/tcp/conn.h (not installed)
//
// Conn: one tcp connection (agents/core/transport.h's Connection) over one socket.
//
// Writes: write() queues a frame (agents/tcp/protocol.h) and, when no other thread is
// writing on the connection, sends what is queued itself, everything in one sendmsg of
// up to IOV_MAX pieces: the frame heads, the metadata, and the tensors from their own
// memory. What the socket does not take waits for EPOLLOUT (the loop or a driver),
// which goes on from where the socket stopped. Calls in flight thus leave in few
// system calls, and a lone call leaves at once, from the thread that made it.
//
// Reads: the thread serving the endpoint (its loop, or a waiting thread that drives it,
// one at a time under Endpoint::step_mu) reads into its scratch buffer and takes frames out
// of it; the bytes of a large piece (metadata or a tensor) still to come are read
// straight into where they land (readv: the rest of the piece, then the scratch).
//
// Ownership: shared, by the endpoint while the connection is open and by the core. The
// socket is closed by the destructor, so that no writer ever writes on a descriptor
// the kernel gave to something else; ending a connection shuts the socket down.
// Members say which lock guards them or which thread alone touches them.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "agents/core/transport.h"
#include "agents/tcp/address.h"
#include "agents/tcp/protocol.h"

namespace ferry::internal::tcp {

struct Endpoint;

class Conn final : public Connection, public std::enable_shared_from_this<Conn> {
 public:
  // `opener`: this worker opened it (its hello goes first; none is read). `peer`
  // names the other side in errors: `worker "b" at 10.0.0.2:5000`.
  Conn(std::shared_ptr<Session> session, std::weak_ptr<Endpoint> home, uint64_t id, int fd, bool opener,
       std::string peer);
  ~Conn() override;

  void write(Wire wire) override;
  void close() override;
  void close_after_writes() override;
  void pause_reads() override;
  void resume_reads() override;
  // The frames queued and their bytes: what the socket has not taken yet.
  Backlog unsent() const override;
  // An accepted connection whose opener's hello named `address`'s tcp line, from the
  // host that line names (the opener binds its socket to the host it listens on).
  bool carries_calls_to(const std::string& address) const override;

  uint64_t id() const { return id_; }
  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }

  // ---- For the endpoint (the serving thread, under its step_mu, unless said otherwise).
  // The opener's hello, queued before any frame (connect()).
  void queue_hello(const HostPort& listening);
  // The socket is ready (the events epoll gave for it).
  void on_events(Endpoint& home, const std::shared_ptr<TransportEvents>& events, uint32_t what);
  // What resume_reads() asked for: the bytes read past the pause first, then the socket.
  void resume(Endpoint& home, const std::shared_ptr<TransportEvents>& events);
  // Ends it (once): no more writes, the socket shut down, the queue dropped. Any thread.
  // True the first time.
  bool finish();
  // Ends it with `why` through the loop, which reports on_closed (any thread).
  void fail(absl::Status why);
  void set_two_way(bool on) { two_way_ = on; }
  // Whether the loop may report its end (not after the transport closed it).
  std::atomic<bool> reported{false};

 private:
  struct Out {
    std::string head;  // FrameHead, entries, targets (or the hello)
    std::string metadata;
    std::vector<Tensor> tensors;
    size_t bytes = 0;
    // Appends the pieces from byte `skip` on to `iov` (at most `room`); how many.
    int pieces(iovec* iov, int room, size_t skip) const;
  };

  void push(Out out);
  // Sends what is queued until the queue is empty or the socket full; the caller owns
  // flushing_. Any thread.
  void flush();
  // Under send_mu_: unsent()'s copy of the queue's size.
  void count_unsent_locked();
  // Under send_mu_: the epoll interest for reading_ and want_out_.
  void update_interest_locked();
  void set_reading(bool on);
  // Reads what the socket has; false when the connection ended.
  bool read_socket(Endpoint& home, const std::shared_ptr<TransportEvents>& events);
  // Takes frames out of `data`; false when the connection ended. What a pause leaves
  // unread goes to carry_.
  bool feed(Endpoint& home, const std::shared_ptr<TransportEvents>& events, const char* data, size_t size);
  // Moves the state on once its piece is complete (one with nothing to read is at
  // once); false when the connection ended.
  bool settle(Endpoint& home, const std::shared_ptr<TransportEvents>& events);
  absl::Status take_hello();
  absl::Status take_head();
  absl::Status take_table(Endpoint& home, TransportEvents& events);
  // Where the bytes of the piece being read go, and how many are still to come.
  char* landing(size_t& left);
  void connected(Endpoint& home);

  const uint64_t id_;
  const int fd_;
  const bool opener_;
  const std::string peer_;
  const std::weak_ptr<Endpoint> home_;
  bool two_way_ = true;

  // Writing.
  mutable std::mutex send_mu_;
  std::deque<Out> queue_;           // guarded by send_mu_
  size_t sent_ = 0;                 // bytes of queue_.front() already sent; guarded by send_mu_
  size_t queued_bytes_ = 0;         // guarded by send_mu_
  bool flushing_ = false;           // a thread sends; guarded by send_mu_
  bool connecting_ = false;         // guarded by send_mu_
  bool want_out_ = false;           // waiting for EPOLLOUT; guarded by send_mu_
  bool reading_ = true;             // EPOLLIN wanted; guarded by send_mu_
  bool close_when_written_ = false; // guarded by send_mu_
  bool interest_set_ = false;       // registered with epoll; guarded by send_mu_
  std::atomic<uint64_t> unsent_messages_{0};
  std::atomic<uint64_t> unsent_bytes_{0};
  std::atomic<bool> writable_{true};
  std::atomic<bool> ended_{false};
  std::atomic<bool> paused_{false};

  // Reading (the serving thread, under Endpoint::step_mu).
  enum class State { kHello, kHead, kTable, kMetadata, kTensor };
  State state_;
  std::string head_;  // the hello, head or table read so far
  size_t need_ = 0;   // bytes of head_ the state needs
  FrameHead frame_;
  std::vector<uint64_t> lengths_;
  Wire wire_;
  size_t tensor_ = 0;  // the tensor being read
  size_t filled_ = 0;  // bytes of the piece being read
  std::string carry_;  // read past a pause, taken first on resuming

  // The opener's listening address from its hello, and where its socket comes from
  // (acceptors). Written by the loop before met_ is set.
  HostPort hello_;
  HostPort from_;
  std::atomic<bool> met_{false};

  friend struct Endpoint;
};

}  // namespace ferry::internal::tcp
