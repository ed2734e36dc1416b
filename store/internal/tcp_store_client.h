// File: store/internal/tcp_store_client.h
//
// TCPStore's client side (TCPStore::Client): blocking sockets to one store server,
// one per call in flight, pooled for reuse. It connects with the protocol's handshake
// (and the job token's challenge-response, when there is a token), retries a
// vanished server for a short window, and turns the server's answers into statuses.
// A private member type of TCPStore; tcp_store.cc uses it so:
//
//   auto client = std::make_unique<Client>(host, port, timeout, max_message_bytes, token);
//   FERRY_RETURN_IF_ERROR(client->connect_first(deadline, /*is_worker=*/true));
//   FERRY_ASSIGN_OR_RETURN(Bytes body, client->call(std::move(writer), "get", wait));
//
// The wire protocol itself is in tcp_protocol.h. Internal: not installed.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "store/internal/tcp_protocol.h"
#include "store/tcp_store.h"

namespace ferry {

namespace internal::tcp_store {

// A connection's socket; closed by the destructor.
struct Socket {
  explicit Socket(int fd) : fd(fd) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd;
};

}  // namespace internal::tcp_store

// Thread-safe: calls may run concurrently, each on a connection of its own.
class TCPStore::Client {
 public:
  using Clock = std::chrono::steady_clock;

  Client(std::string host, uint16_t port, std::chrono::milliseconds timeout, uint32_t max_message_bytes,
         std::string token);

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }

  // Connects the first connection, retrying until `deadline`. Later connections (more
  // threads, reconnects) never count as workers.
  absl::Status connect_first(Clock::time_point deadline, bool is_worker);

  // Sends `request` and returns the answer's body after the status byte. `wait` is how
  // long the server may take before answering (a blocking request's timeout).
  absl::StatusOr<Bytes> call(internal::tcp_store::Writer writer, std::string_view what,
                             std::chrono::milliseconds wait);

  // Closes every idle connection; the next call connects again.
  void close_all();

 private:
  using Socket = internal::tcp_store::Socket;

  std::unique_ptr<Socket> acquire();
  void release(std::unique_ptr<Socket> s);

  // The call's connection broke: the server is probably gone, so its idle siblings
  // are stale too. The next call reconnects.
  absl::Status lost(std::string_view what, const absl::Status& why);

  // A connection that passed the handshake, retrying until `deadline`; past it,
  // kDeadlineExceeded for the `first` connection, else kUnavailable. A server that
  // refuses for good (another protocol, another job token) fails at once.
  absl::StatusOr<std::unique_ptr<Socket>> connect(Clock::time_point deadline, bool is_worker, bool first);
  absl::StatusOr<std::unique_ptr<Socket>> connect_once(Clock::time_point deadline, bool is_worker);

  // Reads one handshake answer: the body after an OK status byte, or the server's
  // refusal as an error (kUnauthenticated for a job-token refusal, kResourceExhausted
  // for a full server, which connect retries; kFailedPrecondition otherwise).
  absl::StatusOr<Bytes> handshake_answer(int fd, Clock::time_point deadline);

  const std::string host_;
  const uint16_t port_;
  const std::string address_;
  const std::chrono::milliseconds timeout_;
  const uint64_t max_message_bytes_;
  const std::string token_;  // "" for none

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Socket>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry
