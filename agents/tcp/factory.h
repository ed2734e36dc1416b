// File: agents/tcp/factory.h
//
// The tcp transport: ferry's own transport over TCP sockets, for workers on any hosts.
// One socket per pair of workers carries calls both ways; everything queued on it
// leaves in one sendmsg; tensors are sent from their own memory and read straight
// into the buffer they land in; a paused connection leaves its bytes in the socket,
// so that a peer that floods this worker waits in its own send queue (bounded:
// TcpOptions::send_queue_bytes). The core's job-token handshake runs on every
// accepted socket before anything else is allocated for it, and caps the sockets
// that have not passed it, closing the oldest first.
//
// A worker's record is "tcp tcp://<host>:<port>": host is the address the interface
// resolver picks (base/net.h; FERRY_SOCKET_IFNAME names the interface).
// It registers as "tcp" in the transport registry (agents/core/registry.h; one line in
// backends/builtin.cc): by default it reaches the peers the ring does not (those on
// other hosts), in place of TensorPipe's uv, which stays selectable by name
// ("transports" or FERRY_TRANSPORTS). TcpAgent makes an agent over tcp alone.
//
//   TcpAgentOptions options;
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> a, TcpAgent::create(store, "a", 0, 2, options, handler));
//
// Threads: each worker runs one loop thread (epoll), which accepts, reads, and delivers
// events (the transport thread of agents/core/transport.h); a ferry thread that waits
// (a caller for its reply, an idle pool thread) reads and delivers in its place while
// it waits (base/progress.h; TcpOptions::driven), so events come on either. Writes are
// sent from the writing thread when the socket takes them, else by the loop or a
// waiting thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "agents/core/registry.h"
#include "agents/core/transport.h"
#include "agents/tcp/options.h"
#include "store/store.h"

namespace ferry {

// The tcp transport alone (the transport conformance suite drives it).
std::unique_ptr<Transport> make_tcp_transport(std::string name, TcpOptions options = {});

// Whether `record` has a well-formed tcp line. Opens nothing; thread-safe.
bool tcp_reaches(const std::string& record);

// The tcp registry entry: "tcp", rank 150, a default that reaches other hosts (so
// TensorPipe's uv is left out of the defaults), judged by tcp_reaches. The maker
// listens where the resolver picks for TransportArgs::store_host, with keepalive
// from TransportArgs::heartbeat.
TransportEntry tcp_transport_entry();

struct TcpAgentOptions {
  // The agent's settings (AgentOptions::auth_token is used as given).
  AgentOptions agent;
  TcpOptions tcp;
  // create(): how long to wait for every worker's address.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(30)};
};

// The tcp agent's makers; it has no instances.
struct TcpAgent {
  TcpAgent() = delete;
  // A static group: start(), then every worker's address through the store.
  static absl::StatusOr<std::shared_ptr<Agent>> create(std::shared_ptr<Store> store, std::string name, int rank,
                                                       int world_size, TcpAgentOptions options,
                                                       RequestHandler handler);
  // Listening, no members yet.
  static absl::StatusOr<std::shared_ptr<Agent>> start(std::shared_ptr<Store> store, std::string name, int rank,
                                                      TcpAgentOptions options, RequestHandler handler);
};

}  // namespace ferry
