// File: agents/ring/factory.h
//
// The ring transport: a ferry-native transport for workers on the same host. Each
// connection is a pair of shared-memory rings; a message is written into the ring in
// place and read out of it, with no allocation per message on either side. Tensors of
// at least RingOptions::in_place_bytes are not copied through the ring: the receiver
// reads them straight out of the sender's memory (process_vm_readv) when the kernel
// lets it, which each side checks once per peer process: the connector by reading the
// probe the acceptor's record names, the acceptor the one the hello names, each in the
// process the kernel says is at the other end of the socket.
//
// A worker's record is "ring ring://<boot id>/<network namespace>/<socket>?probe=<pid>.
// <address>.<value>" (hex): a peer reaches it only from the same boot of the same host
// and the same network namespace.
// It registers as "ring" in the transport registry (agents/core/registry.h; one line
// in backends/builtin.cc), so init_rpc reaches such peers through it, by default or
// when "ring" is among `transports`; RingAgent makes an agent over the ring alone.
//
//   RingAgentOptions options;
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> a, RingAgent::create(store, "a", 0, 2, options, handler));
//
// Threads: each worker runs a data thread, which delivers every event (the transport
// thread of agents/core/transport.h), and a control thread for sockets. An idle data
// thread polls for a while as any waiting thread of ferry does (FERRY_SPIN_US,
// base/future.h: the window adapts, and no polling while the host is crowded), then
// sleeps on a futex: an idle worker uses no CPU.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "agents/core/registry.h"
#include "agents/core/transport.h"
#include "agents/ring/options.h"
#include "store/store.h"

namespace ferry {

// The ring transport alone (the transport conformance suite drives it).
std::unique_ptr<Transport> make_ring_transport(std::string name, RingOptions options = {});

// Whether a ring worker here can reach the worker whose address record is `record`:
// it has a ring line from the same boot of this host and this network namespace.
// Opens nothing; thread-safe.
bool ring_reaches(const std::string& record);

// The ring's registry entry: "ring", rank 100, a default that serves this host's
// peers (so TensorPipe's shm is left out of the defaults), judged by ring_reaches.
// The maker uses RingOptions' defaults (FERRY_RING_* variables).
TransportEntry ring_transport_entry();

struct RingAgentOptions {
  // The agent's settings (AgentOptions::auth_token is used as given).
  AgentOptions agent;
  RingOptions ring;
  // create(): how long to wait for every worker's address.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(30)};
};

// The ring agent's makers; it has no instances.
struct RingAgent {
  RingAgent() = delete;
  // A static group: start(), then every worker's address through the store.
  static absl::StatusOr<std::shared_ptr<Agent>> create(std::shared_ptr<Store> store, std::string name, int rank,
                                                       int world_size, RingAgentOptions options,
                                                       RequestHandler handler);
  // Listening, no members yet.
  static absl::StatusOr<std::shared_ptr<Agent>> start(std::shared_ptr<Store> store, std::string name, int rank,
                                                      RingAgentOptions options, RequestHandler handler);
};

}  // namespace ferry
