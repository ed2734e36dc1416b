// File: agents/inproc/factory.h
//
// InprocAgent: makes the Agent (agents/core/agent.h) over the in-process transport in
// this folder, for tests and for programs that run several workers in one process. A
// worker's address is "inproc:<n>", unique in the process; a message's tensors are
// copied into buffers of the receiver's, as a network would, after the receiver's core
// admitted their sizes. Each worker has one delivery thread (its transport thread).
//
// It is the model for a new transport: this folder, one line in the conformance suites
// (tests/agents/transport_conformance_test.cc, agent_conformance_test.cc), nothing else
// (docs/extending.md).
//
//   InprocAgentOptions options;
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> a, InprocAgent::create(store, "a", 0, 2, options, handler));
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "agents/core/transport.h"
#include "store/store.h"

namespace ferry {

struct InprocAgentOptions {
  // The agent's settings (AgentOptions::auth_token is used as given: no environment
  // default).
  AgentOptions agent;
  // create(): how long to wait for every worker's address.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(30)};
  // For tests of the core's last line of defence: this worker's transport delivers
  // requests past Connection::pause_reads(), so those beyond
  // AgentOptions::max_requests_in_flight reach the core (which refuses them).
  bool ignore_pauses = false;
};

// The in-process transport alone (the transport conformance suite drives it).
std::unique_ptr<Transport> make_inproc_transport(std::string name);

// The in-process agent's makers; it has no instances.
struct InprocAgent {
  InprocAgent() = delete;
  // A static group: start(), then every worker's address through the store
  // (exchange_addresses, under options.agent.store_prefix).
  static absl::StatusOr<std::shared_ptr<Agent>> create(std::shared_ptr<Store> store, std::string name, int rank,
                                                       int world_size, InprocAgentOptions options,
                                                       RequestHandler handler);
  // Listening, no members yet.
  static absl::StatusOr<std::shared_ptr<Agent>> start(std::shared_ptr<Store> store, std::string name, int rank,
                                                      InprocAgentOptions options, RequestHandler handler);
};

}  // namespace ferry
