// File: agents/process_group/factory.h
//
// ProcessGroupAgent: makes the Agent (agents/core/agent.h) over a ferry ProcessGroup
// (Gloo send/recv over TCP), the transport adapter in this folder. It is
// the fallback for hosts where TensorPipe's transports do not work, or that may open
// only one kind of TCP connection.
//
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> group, ProcessGroup::create(store, rank, world_size));
//   ProcessGroupAgentOptions options;
//   options.num_send_recv_threads = 4;
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
// Threads: one receiver per other rank and num_send_recv_threads senders only move
// bytes; requests, future callbacks and membership listeners run on a pool of
// num_send_recv_threads threads (the seed's single knob); one timer thread fails calls
// at their deadline.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "device_maps/device_map.h"
#include "process_group/process_group.h"
#include "store/store.h"

namespace ferry {

struct ProcessGroupAgentOptions {
  static constexpr int kMaxSendRecvThreads = 4096;
  // Sender threads, and the threads running requests, continuations and listeners.
  int num_send_recv_threads = 4;
  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  // Where this worker's CUDA tensors land on each peer, and the reverse maps replies
  // travel back on (from the init handler).
  DeviceMaps device_maps;
  DeviceMaps reverse_device_maps;
  // A peer with calls pending that sends nothing for this long is pinged, and lost when
  // the ping goes unanswered as long again (see TensorPipeAgentSettings). Zero: off.
  std::chrono::milliseconds heartbeat_interval{std::chrono::seconds(5)};
  // Requests to serve on the receiving thread (see InlineFilter); unset: none.
  InlineFilter serves_inline;
  // See AgentOptions::max_requests_in_flight.
  int max_requests_in_flight = 1024;
  // The job token (docs/security.md): unset reads FERRY_AUTH_TOKEN; "" means none. With
  // one, every rank's first message to another is the core's challenge-response
  // (AgentOptions::auth_token).
  std::optional<std::string> auth_token;

  // kInvalidArgument, saying what was expected: num_send_recv_threads outside
  // [1, 4096], a negative rpc_timeout or heartbeat_interval.
  absl::Status validate() const;
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
