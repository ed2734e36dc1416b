// File: agents/process_group/factory.h
//
// ProcessGroupAgent: makes the Agent (agents/core/agent.h) over a ferry ProcessGroup
// (Gloo send/recv over TCP), the transport adapter in this folder. It is
// the fallback for hosts where TensorPipe's transports do not work, or that may open
// only one kind of TCP connection.
//
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> group, ProcessGroup::create(store, rank, world_size));
//   ProcessGroupAgentOptions options;
//   options.agent.num_worker_threads = 4;
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
//                          ProcessGroupAgent::create(std::move(group), store, "worker0", options, handler));
//
// Every message is one byte message of the group (see agents/process_group/transport.h
// for the frame): CPU tensors are copied into it once on
// the sending side and arrive without a copy; CUDA tensors go through the device maps
// like TensorPipeAgent's (staged through host memory).
//
// The group is fixed-size, as Gloo's contexts are: its ranks connect to each other when
// it is created, and no rank can join it later. Membership still changes within it —
// add_member / remove_member take and drop ranks of the group (the conformance suite's
// join-and-leave test does that) — but a worker outside the group cannot join: use
// TensorPipeAgent for groups that grow.
//
// Threads: one receiver per other rank and AgentOptions::num_worker_threads senders
// only move bytes; requests, future callbacks and membership listeners run on a pool
// of as many threads (the seed's single knob, which it calls num_send_recv_threads);
// one timer thread fails calls at their deadline.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "agents/core/options.h"
#include "device_maps/device_map.h"
#include "process_group/process_group.h"
#include "store/store.h"

namespace ferry {

// The agent settings a process-group agent starts from: AgentOptions' but 4 worker
// threads (as many send) and the store keys under "ferry/rpc/pg/".
AgentOptions process_group_agent_defaults();

// Thread-compatible.
struct ProcessGroupAgentOptions {
  // The agent's settings, checked by Agent::start; num_worker_threads is also the
  // number of sender threads. AgentOptions::auth_token is used as given: no
  // environment default. With a token, every rank's first message to another is the
  // core's challenge-response.
  AgentOptions agent = process_group_agent_defaults();
};

// The process-group agent's makers; it has no instances. The agent owns the group it
// is given: shutdown() shuts the group down too (the only way to end a Gloo receive).
struct ProcessGroupAgent {
  ProcessGroupAgent() = delete;

  // A static group: every rank of `group` is a member, id = rank, named by an
  // all-gather of the names over the group (so every rank calls create()). `store`
  // serves join(). Errors: bad options, a non-member group handle, duplicate names
  // (on every rank, naming both ranks), the group's errors.
  static absl::StatusOr<std::shared_ptr<Agent>> create(std::shared_ptr<ProcessGroup> group,
                                                       std::shared_ptr<Store> store, std::string name,
                                                       ProcessGroupAgentOptions options, RequestHandler handler);
  // Starts serving with no members yet (the caller adds them: ranks of the group, at
  // addresses process_group_address(rank)).
  static absl::StatusOr<std::shared_ptr<Agent>> start(std::shared_ptr<ProcessGroup> group,
                                                      std::shared_ptr<Store> store, std::string name,
                                                      ProcessGroupAgentOptions options, RequestHandler handler);
  // The group an agent start() made travels on (its collectives stay usable
  // alongside); null for an agent over another transport.
  static ProcessGroup* process_group(Agent& agent);
};

}  // namespace ferry
