// TCPStore's server logic without sockets: the keys, the parked waiters and every
// connection's request parsing, driven by events (a connection opened, bytes arrived,
// its timer fired, its writes drained, it went away). The libuv server
// (tcp_store_server.cc) feeds it from its loop thread; the fuzzer and the unit tests
// feed it directly. Internal: not installed.
//
// Connections are named by ids, never by pointers, so no bookkeeping slip can reach
// freed memory: a waiter list that still named a closed connection would only miss a
// lookup. Each parked connection is registered under each of its keys at most once
// and is removed from all of them when it wakes, times out or closes.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "store/internal/tcp_protocol.h"
#include "store/store.h"

namespace ferry::internal::tcp_store {

using ConnId = uint64_t;

// What the core asks of the transport. Called only from inside the core's methods, on
// the thread that drives the core; none of them may call back into the core.
class ServerTransport {
 public:
  virtual ~ServerTransport() = default;
  // Queues a whole frame (header included) on connection `id`, after earlier ones.
  virtual void write(ConnId id, Bytes frame) = 0;
  // Bytes queued on `id` that the peer has not taken yet.
  virtual size_t queued_bytes(ConnId id) const = 0;
  // Closes `id` (after its queued writes when `flush`). The core has forgotten it
  // already; the transport must not report events for it any more.
  virtual void close(ConnId id, bool flush) = 0;
  // Arms (replacing any) or stops `id`'s one timer; when it fires the transport calls
  // ServerCore::on_timeout.
  virtual void start_timer(ConnId id, std::chrono::milliseconds after) = 0;
  virtual void stop_timer(ConnId id) = 0;
  // Stops or resumes reading from `id` (back-pressure, see ServerLimits::max_queued_bytes).
  virtual void set_reading(ConnId id, bool reading) = 0;
};

struct ServerLimits {
  // Requests and answers larger than this are refused.
  uint32_t max_message_bytes = 64u << 20;
  // Connections served at once; more are answered with kResourceExhausted and closed.
  size_t max_connections = 1024;
  // A connection whose unread answers exceed this has its further requests held back
  // (and is not read from) until the peer takes them: a client that sends without
  // reading cannot grow the server's memory without bound.
  size_t max_queued_bytes = 4u << 20;
  // An input buffer whose capacity grew past this (one large request) is released as
  // soon as it has been handled.
  size_t keep_buffer_bytes = 64u << 10;
  // The workers of this server's run: a worker handshake beyond it (counting every
  // worker ever admitted, those gone included) is refused with
  // kResourceExhausted (its client retries), since it belongs to another run, e.g. the
  // next run's rank reaching this run's server before the server has shut down.
  std::optional<int64_t> world_size;
  // A connection that has not completed its handshake (the hello, and with a token
  // the proof) this long after it opened is closed.
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(5)};
  // Connections still in their handshake, at most: a new one past it closes the
  // oldest of them. They are closed too, oldest first, to make room when the server
  // is at max_connections, so silent or unauthenticated connections never keep out a
  // client that completes its handshake.
  size_t max_handshaking = 512;
  // The job token ("" for none). With one, a connection is served only after it
  // proves it knows the token (see tcp_protocol.h); without one, a client that
  // presents a token is refused too (it expects this server to prove one).
  std::string auth_token;
};

// Thread-compatible: one thread (the libuv loop) drives it.
class ServerCore {
 public:
  ServerCore(ServerTransport& transport, ServerLimits limits) : transport_(transport), limits_(limits) {}
  ServerCore(const ServerCore&) = delete;
  ServerCore& operator=(const ServerCore&) = delete;

  // A connection was accepted. Returns false (and has already answered and closed it
  // through the transport) when the server is at max_connections with connections
  // that all completed their handshake; otherwise it closes the oldest connection
  // still in its handshake when there is no room for a new one (see max_handshaking).
  bool on_open(ConnId id, std::string peer);
  // Bytes arrived on `id`.
  void on_data(ConnId id, const uint8_t* data, size_t size);
  // `id`'s queued writes fell (the transport calls this after each completed write):
  // held-back requests run.
  void on_drained(ConnId id);
  // `id`'s timer fired.
  void on_timeout(ConnId id);
  // The peer went away or the socket failed; `reason` is logged when not empty.
  void on_disconnect(ConnId id, std::string_view reason);
  // Closes every connection (server shutdown).
  void close_all();

  // Workers whose connection passed the handshake and is still open.
  int64_t num_workers() const { return workers_; }
  // Workers ever admitted, those gone included.
  int64_t workers_admitted() const { return workers_admitted_; }
  size_t num_connections() const { return conns_.size(); }
  // Connections that have not completed their handshake.
  size_t num_handshaking() const { return handshaking_.size(); }
  // For tests: how many connections wait on `key`, and the capacity of `id`'s input
  // buffer (0 when it is unknown).
  size_t num_waiters(std::string_view key) const;
  size_t input_capacity(ConnId id) const;
  // For tests and the fuzzer: whether the waiter bookkeeping is consistent (every
  // waiter entry names a live parked connection registered under that key, and back).
  bool invariants_hold() const;
  // For tests: called before each request is handled, may throw to exercise the
  // handler's exception path.
  void set_request_hook_for_testing(std::function<void(uint8_t op)> hook) { hook_ = std::move(hook); }

 private:
  struct Parked {
    Op op;
    std::vector<std::string> keys;  // as asked, duplicates included (multi_get answers each)
    std::chrono::steady_clock::time_point start;
  };
  struct Conn {
    std::string peer;
    bool greeted = false;
    // Between the hello and the kAuth that proves the token: the nonces, and whether
    // the hello asked to count as a worker.
    bool awaiting_proof = false;
    bool wants_worker = false;
    std::string client_nonce;
    std::string server_nonce;
    // Counted in workers_ (uncounted when it closes).
    bool worker = false;
    Bytes in;
    size_t in_pos = 0;
    std::optional<Parked> parked;
    // The distinct keys it is registered under in waiters_ while parked.
    absl::flat_hash_set<std::string> registered;
    bool reading = true;
  };

  Conn* find(ConnId id);
  // Closes the connection that has been in its handshake longest, if any.
  bool evict_oldest_handshaking(std::string_view why);
  // Runs `id`'s buffered requests until one parks, the connection closes, or its
  // answers back up.
  void process(ConnId id);
  bool backed_up(ConnId id) const { return transport_.queued_bytes(id) > limits_.max_queued_bytes; }
  void update_reading(ConnId id, Conn& conn);
  // Handles one request; false when the connection was closed.
  bool handle(ConnId id, Conn& conn, const uint8_t* body, size_t size);
  bool handle_request(ConnId id, Conn& conn, const uint8_t* body, size_t size);
  bool handle_hello(ConnId id, Conn& conn, Reader& r);
  bool handle_auth(ConnId id, Conn& conn, Reader& r);
  // Serves the connection from now on (counting it as a worker when it asked to), or
  // refuses it when the run already has all its workers.
  bool admit(ConnId id, Conn& conn, bool is_worker);
  // Answers `to_client` and closes, logging `reason`.
  void refuse(ConnId id, const absl::Status& to_client, std::string_view reason);
  void close(ConnId id, std::string_view reason, bool flush = false);
  // Sends an answer, or kResourceExhausted in its place when it exceeds the limit.
  void respond(ConnId id, std::string_view op, Writer answer);

  bool has_all(const std::vector<std::string>& keys) const;
  void answer_wait(ConnId id, Op op, const std::vector<std::string>& keys);
  void park(ConnId id, Conn& conn, Op op, std::vector<std::string> keys, uint64_t timeout_ms);
  // Forgets `conn`'s parked request and every waiter entry it has.
  void unpark(ConnId id, Conn& conn);
  void set_key(std::string key, Bytes value);
  void release_buffer(Conn& conn);

  ServerTransport& transport_;
  const ServerLimits limits_;
  absl::flat_hash_map<ConnId, std::unique_ptr<Conn>> conns_;
  absl::flat_hash_map<std::string, Bytes> data_;
  absl::flat_hash_map<std::string, absl::flat_hash_set<ConnId>> waiters_;
  // Connections still in their handshake, oldest (smallest id: ids grow) first.
  std::set<ConnId> handshaking_;
  uint64_t evicted_ = 0;  // handshaking connections closed to make room
  int64_t workers_ = 0;           // worker connections open now
  int64_t workers_admitted_ = 0;  // worker connections ever admitted (world_size refusal)
  std::function<void(uint8_t)> hook_;
};

}  // namespace ferry::internal::tcp_store
