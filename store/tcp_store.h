// File: store/tcp_store.h
//
// TCPStore: a Store served over TCP, for jobs that span hosts. One process (rank 0,
// or a standalone `ferry store serve`) runs a TCPStoreServer; every rank, rank 0
// included, talks to it through a TCPStore client.
//
//   // rank 0: hosts the server in-process and returns once all 4 ranks connected.
//   FERRY_ASSIGN_OR_RETURN(auto store, ferry::TCPStore::create("10.0.0.1", 29500, /*is_server=*/true,
//                                                              /*world_size=*/4, std::chrono::seconds(30)));
//   // ranks 1..3: connect, retrying until the server is up or the timeout passes.
//   FERRY_ASSIGN_OR_RETURN(auto store, ferry::TCPStore::create("10.0.0.1", 29500, false, 4,
//                                                              std::chrono::seconds(30)));
//   FERRY_ASSIGN_OR_RETURN(ferry::Bytes addr, store->get("addr/0"));
//
// Port 0 makes the server pick a free port (TCPStore::port() reports it), for a server
// whose port reaches the clients some other way.  The client side needs no libuv.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "store/store.h"

namespace ferry {

// Requests (and responses) larger than this close the connection that sent them.
inline constexpr uint32_t kDefaultMaxStoreMessageBytes = 64u << 20;

struct TCPStoreServerOptions {
  // The address to listen on: a host name or IP. Empty (the default): the interface
  // the shared resolver picks (base/net.h: FERRY_SOCKET_IFNAME, else the host name's
  // address, else loopback; docs/networking.md). "0.0.0.0" (every IPv4 interface) or
  // "::" (every interface) only when asked, and logged at info.
  std::string host;
  // 0 picks a free port; TCPStoreServer::port() reports it.
  uint16_t port = 0;
  // Requests larger than this close their connection; answers larger than this (a
  // multi_get of many or repeated large keys) fail with kResourceExhausted.
  uint32_t max_message_bytes = kDefaultMaxStoreMessageBytes;
  // Connections served at once. A client beyond it is answered kResourceExhausted and
  // closed; TCPStore's connect retries it until its timeout.
  size_t max_connections = 1024;
  // A connection that has not completed its handshake (the hello and, with a token,
  // its proof) within handshake_timeout is closed. At most max_handshaking connections
  // may be in their handshake at once: a new one closes the oldest of them, as does a
  // new one when the server is at max_connections, so silent or unauthenticated
  // connections cannot keep a legitimate client out. 512 lets that many workers join
  // at once without any being closed (they retry) while their handshakes queue for the
  // server's thread; 64 closed half of 256 workers starting together on 2 cores.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(5);
  size_t max_handshaking = 512;
  // Answers a connection may leave unread before the server stops handling (and
  // reading) its further requests until it reads them.
  size_t max_queued_bytes = 4u << 20;
  // The number of workers of this server's run. When set, a worker that connects after
  // that many did (those that left since included) is refused (kResourceExhausted; TCPStore's connect retries until its
  // timeout): it belongs to another run, typically the next run's rank reaching this
  // run's server before it shut down. Tools and probes (not workers) are not counted.
  std::optional<int64_t> world_size = std::nullopt;
  // The job token (docs/security.md): unset reads FERRY_AUTH_TOKEN; "" means none.
  // With a token, a client is served (and counted as a worker) only after it proved it
  // knows the token; one that did not is refused with kUnauthenticated and the reason
  // logged. Without one, a listener on a non-loopback address logs a warning, once.
  std::optional<std::string> auth_token = std::nullopt;
};

// The store's server: one libuv event-loop thread serves up to max_connections
// clients. A get or wait whose keys are missing is parked, costing no thread, and
// answered when the keys are set or its timeout passes. A client that sends a
// malformed, truncated or oversized request, or whose request makes a handler fail, is
// disconnected with a logged reason; other clients and their keys are not affected.
// The limits are in TCPStoreServerOptions (see docs/hardening.md).
//
// Thread-safe: every method may be called from any thread. Owns its loop thread, which
// shutdown() (or the destructor) stops and joins. Creating a server makes the process
// ignore SIGPIPE if it had the default action, so that a vanished client cannot kill
// it while the loop writes an answer.
class TCPStoreServer {
 public:
  // Binds, listens and starts the loop thread; fails if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<TCPStoreServer>> create(const TCPStoreServerOptions& options = {});
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  // The address it listens on (the resolver's numeric choice when options.host was
  // empty, else options.host as given) and the port it is bound to.
  const std::string& host() const;
  uint16_t port() const;

  // How many clients are connected as workers (see TCPStoreOptions::world_size): a
  // worker connection counts once it passed the handshake, until it closes.
  int64_t num_workers() const;
  // Waits until at least `n` workers have joined (passed the handshake), those that
  // have closed since included: a worker that joined and already left (its init
  // failed fast, say) still joined. kDeadlineExceeded otherwise.
  absl::Status wait_for_workers(int64_t n, std::chrono::milliseconds timeout) const;
  // Clients connected right now.
  int64_t num_connections() const;

  // Closes every connection (their clients see kUnavailable) and joins the loop
  // thread. Idempotent.
  void shutdown();

 private:
  class Impl;
  explicit TCPStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct TCPStoreOptions {
  // The server's address, as the other ranks reach it.
  std::string host = "127.0.0.1";
  // With is_server: where the server listens. Unset: `host` itself when it is an
  // address of this host (or loopback); "0.0.0.0" / "::" as `host` means every
  // interface, as asked; otherwise (a name or address this host does not own, behind
  // NAT or a service IP) the interface the shared resolver picks for reaching `host`
  // (base/net.h). Set it to override ("0.0.0.0" or "::" for every interface).
  std::optional<std::string> listen_host;
  // With is_server, 0 picks a free port (see TCPStore::port()).
  uint16_t port = 0;
  // Whether this TCPStore starts the server in-process (rank 0).
  bool is_server = false;
  // The number of ranks that will connect, rank 0 included. A store given a world
  // size connects as a worker (tools and probes, without one, are not counted). With
  // is_server and wait_for_workers, create() returns only when world_size workers have
  // connected.
  std::optional<int> world_size;
  bool wait_for_workers = true;
  // Default timeout of blocking operations, and how long create() keeps retrying to
  // connect (and waiting for workers).
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  // The largest request this client sends (larger ones fail with kInvalidArgument),
  // and the in-process server's limit.
  uint32_t max_message_bytes = kDefaultMaxStoreMessageBytes;
  // The job token, the client's and (is_server) the in-process server's: unset reads
  // FERRY_AUTH_TOKEN; "" means none. Client and server must agree: a mismatch (one
  // side without a token included) fails create() with kUnauthenticated saying what to
  // set. Never sent: each side proves it knows it (docs/security.md).
  std::optional<std::string> auth_token;
};

// A client of a TCPStoreServer, owning that server when it is rank 0's.
//
// Thread-safe: every method may be called from any thread at once; each call in flight
// uses its own connection (idle ones are reused), so a thread blocked in get() never
// holds up another's set(). A connection lost in the middle of a call fails that call
// with kUnavailable (it is not retried: add is not idempotent); the next call connects
// again, and fails with kUnavailable if the server stays unreachable. A blocking call
// that times out fails with kDeadlineExceeded naming its keys and the time waited. A
// send the server does not take within the store's timeout fails with kUnavailable.
class TCPStore final : public Store {
 public:
  static absl::StatusOr<std::unique_ptr<TCPStore>> create(const TCPStoreOptions& options);
  static absl::StatusOr<std::unique_ptr<TCPStore>> create(std::string host, uint16_t port, bool is_server,
                                                          std::optional<int> world_size,
                                                          std::chrono::milliseconds timeout = kDefaultTimeout);
  // Closes the client's connections, then (rank 0) shuts the server down.
  ~TCPStore() override;

  using Store::get;
  using Store::multi_get;
  using Store::wait;

  absl::Status set(std::string_view key, const Bytes& value) override;
  absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) override;
  absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) override;
  absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::Status wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) override;
  absl::StatusOr<bool> delete_key(std::string_view key) override;
  absl::StatusOr<int64_t> num_keys() override;
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                               std::optional<std::chrono::milliseconds> timeout) override;
  absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

  const std::string& host() const;
  // The server's port (the bound one when this store started it on port 0).
  uint16_t port() const;
  // The in-process server on rank 0, else nullptr. Owned by this store.
  TCPStoreServer* server() const { return server_.get(); }

 private:
  class Client;
  TCPStore(std::unique_ptr<TCPStoreServer> server, std::unique_ptr<Client> client, std::chrono::milliseconds timeout);

  std::unique_ptr<TCPStoreServer> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace ferry
