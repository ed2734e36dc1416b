// File: agents/tcp/endpoint.h (not installed)
//
// Endpoint: the state one worker's tcp transport shares with its loop thread and its
// connections (agents/tcp/conn.h), and the code of that thread.
//
// The loop thread (run) waits in epoll on the listening socket, a wake-up eventfd and
// the connections' epoll set (data_fd): it accepts, finishes connects, reads every
// socket, finishes writes the socket could not take at once, runs the commands other
// threads post (resume a paused connection, report one's end) and delivers every
// event: it is the transport thread of agents/core/transport.h.
//
// A ferry thread that waits (a caller for its reply, an idle pool thread) drives the
// connections itself (base/progress.h): it serves data_fd as the loop would, so that a
// reply is read by the thread waiting for it and a request by the pool thread that
// runs it, with no hand-off through the loop. While a thread drives, data_fd is
// disarmed in the loop's set (one-shot), so that the loop does not wake for what the
// driver reads; the last driver to leave arms it again. A pool thread that steps away
// to run a task leaves it disarmed: the loop then serves within kBesideDriver.
// Reading is serialized by step_mu, held by whichever thread serves.
//
// Ownership: TcpTransport (agents/tcp/transport.h) owns the endpoint and starts and
// joins its thread; the thread holds it too (shared), connections only weakly.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/transport.h"
#include "agents/tcp/address.h"
#include "base/progress.h"

namespace ferry::internal::tcp {

class Conn;

// A piece still to come of at least this many bytes is read straight where it lands;
// smaller ones through the scratch buffer, with whatever follows them.
inline constexpr size_t kDirectReadBytes = 32 * 1024;
// The loop's scratch buffer: one per worker, however many connections it has.
inline constexpr size_t kScratchBytes = 256 * 1024;
// How long the loop sleeps while data_fd is disarmed (a thread drives, or stepped away
// to run a task): what arrives when nobody drives waits at most this long.
inline constexpr std::chrono::milliseconds kBesideDriver{1};

struct Endpoint : std::enable_shared_from_this<Endpoint> {
  std::string name;
  HostPort where;       // where it listens
  std::string address;  // its record
  size_t send_queue_bytes = 0;
  std::chrono::milliseconds keepalive{0};
  bool two_way = true;
  bool driven = true;  // waiting threads drive the connections (TcpOptions::driven)
  std::weak_ptr<TransportEvents> events;
  std::shared_ptr<BufferPool> buffers = BufferPool::create(max_cached_receive_bytes());

  int listen_fd = -1;
  int epoll_fd = -1;  // the loop's: the listener, wake_fd, data_fd
  int data_fd = -1;   // every connection's socket
  int wake_fd = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::atomic<bool> listening{false};

  // Work for the loop thread.
  struct Command {
    enum Kind { kResume, kEnd } kind;
    std::shared_ptr<Conn> conn;
    absl::Status why;
  };
  std::mutex mu;
  std::vector<Command> commands;                                // guarded by mu
  absl::flat_hash_map<uint64_t, std::shared_ptr<Conn>> conns;  // every open connection; guarded by mu
  std::atomic<uint64_t> next_id{2};                             // 0: the listener, 1: the wake fd

  // Held by the thread that serves data_fd (the loop or a driver): the connections'
  // reading state and the scratch buffer are its.
  std::mutex step_mu;
  // Drivers, and whether data_fd is armed in the loop's set (guarded by arm_mu).
  std::mutex arm_mu;
  int drivers = 0;
  bool armed = false;
  bool loop_bounded = false;  // the loop sleeps for at most kBesideDriver
  std::unique_ptr<ProgressRegistration> progress;

  std::vector<char> scratch = std::vector<char>(kScratchBytes);  // guarded by step_mu
  // The loop thread's.
  std::chrono::steady_clock::time_point accept_again{};  // after running out of descriptors
  bool accept_paused = false;

  std::atomic<uint64_t> opened{0}, accepted{0}, messages_in{0}, messages_out{0}, sends{0}, partial_sends{0},
      reads{0}, direct_reads{0}, accept_backoffs{0}, queue_full{0}, driven_steps{0}, loop_steps{0}, loop_wakes{0};

  // Posts `command` and wakes the loop; dropped once the transport stops.
  void post(Command command);
  // Registers an open connection: in the table, then with epoll for `what`.
  void add(const std::shared_ptr<Conn>& conn, uint32_t what);
  // Loop thread: ends `conn` and reports why (once, unless the transport closed).
  void end(const std::shared_ptr<Conn>& conn, absl::Status why, const std::shared_ptr<TransportEvents>& events);
  // Socket options every connection gets: TCP_NODELAY, keepalive.
  void tune(int fd) const;

  // Under step_mu: serves the connections whose sockets are ready; true if any were.
  bool serve(const std::shared_ptr<TransportEvents>& events);
  // A waiting thread's poll (base/progress.h): serves unless another thread does.
  bool drive();
  void enter_driver();
  // briefly: a pool thread steps away to run a task (Progress::step_away).
  void leave_driver(bool briefly);
  // Under arm_mu: arms or disarms data_fd in the loop's set.
  void arm_locked(bool on);

  void run();
  void on_listener(const std::shared_ptr<TransportEvents>& events);
  void run_commands(const std::shared_ptr<TransportEvents>& events);
};

}  // namespace ferry::internal::tcp
