// File: agents/ring/endpoint.h (not installed)
//
// Endpoint: the state one worker's ring transport shares with its two threads and its
// connections (agents/ring/pipe.h), and the code of those threads.
//
// - The data thread (run_data) takes the commands posted to it, reads and writes every
//   pipe's rings, delivers every event (the transport thread of agents/core/transport.h),
//   and sleeps on the worker's bell when idle (park). A thread of the worker that polls
//   while it waits (base/progress.h) steps the rings in its place meanwhile (drive,
//   enter_driver, leave_driver); step_mu lets one thread step at a time. Neither
//   reads a tensor in place: reader threads do (agents/ring/read_pool.h), and a step
//   delivers the message once they are done.
// - The control thread (run_control) accepts sockets, exchanges the memfds (the hello
//   and its reply, then the bells once each core authenticated its peer,
//   agents/ring/protocol.h), takes the wakes of peers that have no bell yet, and
//   watches each socket for its end.
//
// Ownership: RingTransport (agents/ring/transport.h) owns the endpoint and starts and
// joins its threads; the threads and the progress registration hold it too (shared),
// pipes only weakly. Members say which lock guards them or which thread alone
// touches them.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/transport.h"
#include "agents/ring/ring.h"
#include "agents/ring/read_pool.h"
#include "agents/ring/unix_socket.h"
#include "base/future.h"
#include "base/progress.h"

namespace ferry::internal::ring {

class Pipe;

// The state one worker's transport shares with its threads and connections.
struct Endpoint : std::enable_shared_from_this<Endpoint> {
  std::string name;
  size_t ring_bytes = 0;
  size_t in_place_bytes = 0;
  size_t max_held_bytes = 0;  // RingOptions::max_held_bytes, per connection
  bool two_way = true;  // accepted connections carry this worker's calls too
  bool any_user = false;  // peers of other users get past the hello (RingOptions::any_user)
  std::string socket_name;
  std::string address;
  std::weak_ptr<TransportEvents> events;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());
  uint64_t probe = 0;  // a value peers read in place to learn whether they can
  // Large tensors read in place, on reader threads (never the one that steps): a
  // message whose reads do not finish waits in its pipe (Pipe::receive), and its
  // connection is closed once they made no progress for read_timeout
  // (RingOptions::in_place_read_timeout).
  std::unique_ptr<ring::ReadPool> reads;
  std::chrono::milliseconds read_timeout{5000};

  int listen_fd = -1;
  int epoll_fd = -1;
  int stop_fd = -1;
  int bell_fd = -1;
  Mapping bell_map;
  ring::Bell* bell = nullptr;
  std::thread data_thread;
  std::thread control_thread;
  std::atomic<bool> stopping{false};
  std::atomic<bool> listening{false};

  // Work for the data thread, which delivers every event.
  struct Command {
    enum Kind { kAdd, kGone, kClose } kind;
    std::shared_ptr<Pipe> pipe;
    absl::Status why;
  };
  std::mutex mu;
  std::deque<Command> commands;  // guarded by mu
  std::atomic<bool> has_commands{false};
  // The control thread's sockets, by id: accepted ones awaiting their hello own their
  // descriptor here; the others belong to their Pipe.
  struct Socket {
    int fd = -1;
    std::weak_ptr<Pipe> pipe;
    bool awaiting_hello = false;  // accepted, no pipe yet: the fd is owned here
  };
  absl::flat_hash_map<uint64_t, Socket> sockets;  // guarded by mu
  // Accepted sockets awaiting their hello, oldest first, each with when it is closed
  // unsaid (hello_timeout after it came).
  struct PendingHello {
    uint64_t id;
    std::chrono::steady_clock::time_point due;
  };
  std::deque<PendingHello> pending_hellos;  // guarded by mu
  std::chrono::milliseconds hello_timeout{5000};
  std::atomic<uint64_t> next_id{16};               // below: the listener, the stop fd

  // Whoever steps holds step_mu: the data thread, or a thread that polls the rings
  // while it waits for something (base/progress.h: a caller for its reply, an idle
  // pool thread for a request). While such drivers are there, the data thread sleeps
  // and peers need not ring: the last driver to leave asks them to again.
  std::mutex step_mu;
  std::vector<std::shared_ptr<Pipe>> active;  // guarded by step_mu
  // The pipes whose current message is being read in place (guarded by step_mu): a
  // step serves them once their reads finished or stalled (reads_due), whatever the news.
  std::vector<std::shared_ptr<Pipe>> reading;
  std::atomic<size_t> reads_in_flight{0};  // reading.size(), readable without step_mu
  // The pipes with a bit in this endpoint's news, by slot (guarded by step_mu), how
  // many news words are in use, and how many active pipes have no slot. With
  // news_from connections or more, a step reads only the rings whose bit is set.
  std::vector<Pipe*> by_slot;
  size_t news_words = 0;
  size_t unslotted = 0;
  size_t news_from = 16;
  // Set after the data thread slept, at most every kReadAllEvery: the next step reads
  // every ring, since news is written by peers and only a hint. Not after every
  // sleep: 256 workers on 2 cores sleep and wake for nearly every message.
  std::atomic<bool> read_all{false};
  int64_t read_all_at_ns = 0;  // data thread only
  std::atomic<size_t> pipes{0};  // active.size(), readable without step_mu
  // Slots not in use (guarded by mu).
  std::vector<uint32_t> free_slots;
  uint32_t next_slot = 0;
  std::atomic<int> drivers{0};
  std::atomic<bool> parked{false};  // the data thread sleeps on the bell
  // The data thread sleeps beside a driver, for at most kBesideDriver: a driver that
  // steps away to run a task then leaves the bell quiet (peers make no system call)
  // and the data thread still reads what comes within that bound.
  std::atomic<bool> parked_briefly{false};
  // Drivers that are ferry's own threads (a pool's): only they step away, so only
  // beside them does the data thread sleep briefly. Beside a user's waiting thread it
  // sleeps until rung: waking every kBesideDriver there halved 16 calls in flight.
  std::atomic<int> agent_drivers{0};
  std::unique_ptr<ProgressRegistration> progress;
  // Peers' bells, each mapped once however many connections its worker has with this
  // one, by the memfd's device and inode (control thread). A mapping per connection
  // was one more mmap and munmap per connection on each side.
  std::mutex bells_mu;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::weak_ptr<const Mapping>> peer_bells;  // guarded by bells_mu
  size_t bells_after_sweep = 0;  // guarded by bells_mu
  // What reading a peer process's probe in place found, by (pid, address, value): the
  // same for every connection with that process, so probed once, not twice per
  // connection. A new process behind a reused pid has another probe value.
  std::mutex probes_mu;
  absl::flat_hash_map<std::tuple<pid_t, uint64_t, uint64_t>, bool> probes;  // guarded by probes_mu
  // Whether this process can read `value` at `address` in process `pid` (any thread).
  bool reads_in_place(pid_t pid, uint64_t address, uint64_t value);

  std::atomic<uint64_t> opened{0}, accepted{0}, refused{0}, sleeps{0}, in_place_reads{0}, messages_in{0},
      messages_out{0}, driven{0}, news_steps{0}, stepped_away{0};
  // kWake packets taken (peers that have no bell of this worker's yet), and those not
  // acted on (an unauthenticated peer past Pipe::kMaxUnauthenticatedWakes).
  std::atomic<uint64_t> wakes{0}, wakes_ignored{0};
  std::atomic<uint64_t> hello_timeouts{0};  // sockets closed for saying no hello in time
  std::atomic<uint64_t> read_timeouts{0};   // connections closed for an in-place read that stalled
  // Bytes of tensors all connections hold for their peers to read in place, and tensors
  // sent by copy because their connection held RingOptions::max_held_bytes.
  std::atomic<uint64_t> held_bytes{0}, copied_past_held{0};
  PollWindow window;  // the data thread's polls

  // Rings the data thread, except for a new pipe (kAdd): its first message rings (a peer
  // that writes rings the bell), and every step takes the commands first. A sleeping
  // data thread woken only to add the pipe, once per side of every new connection, was
  // a third of its wake-ups in all-to-all calls among 256 workers.
  void post(Command command);

  // A slot for a new pipe's news, or ring::kNoSlot when all are taken (control thread
  // or a connecting thread); give_slot returns one.
  uint32_t take_slot();
  void give_slot(uint32_t slot);
  // Under step_mu: whether a step reads only the rings with news.
  bool reading_news() const { return active.size() >= news_from && unslotted == 0; }
  // The read-all period and the longest sleep (kReadAllEvery).
  std::chrono::microseconds read_all_every() const;
  void add_pipe(const std::shared_ptr<Pipe>& pipe);
  // Under step_mu: whether a pipe in `reading` has its reads finished or stalled.
  bool reads_due() const;
  void remove_swept();
  // Under step_mu: reads and writes what `pipe` has; true when it moved something.
  bool serve_pipe(const std::shared_ptr<Pipe>& pipe, const std::shared_ptr<TransportEvents>& e, bool& sweep);

  void run_data();
  bool park();
  bool step();
  bool ready() const;
  bool drive();
  void enter_driver();
  // briefly: the driver steps away to run a task it found (Progress::step_away).
  void leave_driver(bool briefly = false);
  void run_control();
  void on_listener();
  // Closes the sockets whose hello is overdue; how long until the next one is (-1: none
  // waits), for the control thread's epoll_wait.
  int expire_hellos();
  void on_socket(uint64_t id, uint32_t what);
  void accept_hello(uint64_t id, int fd);
  void watch(uint64_t id, int fd, std::weak_ptr<Pipe> pipe, bool awaiting_hello = false);
  void report(const std::shared_ptr<Pipe>& pipe, absl::Status why);
  // The mapping of the bell memfd `fd` a peer sent (checked as map_peer_memfd does).
  absl::StatusOr<std::shared_ptr<const Mapping>> map_peer_bell(int fd);
};

}  // namespace ferry::internal::ring
