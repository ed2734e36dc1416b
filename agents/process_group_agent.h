// File: agents/process_group_agent.h
//
// ProcessGroupAgent: the RpcAgent over a ferry ProcessGroup (Gloo send/recv over TCP)
// — the same agent core as TensorPipeAgent (call table, serving, membership, device
// staging, shutdown; agents/internal/) over a process-group transport adapter. It is
// the fallback for hosts where TensorPipe's transports do not work, or that may open
// only one kind of TCP connection.
//
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> group, ProcessGroup::create(store, rank, world_size));
//   ProcessGroupAgentOptions options;
//   options.num_send_recv_threads = 4;
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ProcessGroupAgent> agent,
//                          ProcessGroupAgent::create(std::move(group), store, "worker0", options, handler));
//
// Every message is one byte message of the group (see agents/internal/
// process_group_transport.h for the frame): CPU tensors are copied into it once on
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
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/rpc_agent.h"
#include "device_maps/device_map.h"
#include "process_group/process_group.h"
#include "store/store.h"

namespace ferry {

namespace internal {
class AgentCore;
class ProcessGroupTransport;
}  // namespace internal

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

  // kInvalidArgument, saying what was expected: num_send_recv_threads outside
  // [1, 4096], a negative rpc_timeout or heartbeat_interval.
  absl::Status validate() const;
};

// Thread-safe. Owned by shared_ptr. Dropping the last reference shuts it down (not
// gracefully), from any thread. The agent owns the group it is given: shutdown() shuts
// the group down too (the only way to end a Gloo receive).
class ProcessGroupAgent final : public RpcAgent {
 public:
  // A static group: every rank of `group` is a member, id = rank, named by an
  // all-gather of the names over the group (so every rank calls create()). `store`
  // serves join(). Errors: bad options, a non-member group handle, duplicate names
  // (on every rank, naming both ranks), the group's errors.
  static absl::StatusOr<std::shared_ptr<ProcessGroupAgent>> create(std::shared_ptr<ProcessGroup> group,
                                                                    std::shared_ptr<Store> store, std::string name,
                                                                    ProcessGroupAgentOptions options,
                                                                    RequestHandler handler);
  // Starts serving with no members yet (the caller adds them: ranks of the group).
  static absl::StatusOr<std::shared_ptr<ProcessGroupAgent>> start(std::shared_ptr<ProcessGroup> group,
                                                                   std::shared_ptr<Store> store, std::string name,
                                                                   ProcessGroupAgentOptions options,
                                                                   RequestHandler handler);
  ~ProcessGroupAgent() override;

  // "pg:<rank>": what add_member needs to reach this worker.
  const std::string& address() const;
  // A worker at `address` ("pg:<rank>", a rank of this group) joined / left. kAlreadyExists
  // for a duplicate name or id; a bad address fails the first call to it.
  absl::Status add_member(WorkerInfo info, std::string address);
  absl::Status remove_member(int id, MembershipChange why);

  // The group the messages travel on (its collectives stay usable alongside).
  ProcessGroup& process_group();

  Future<Message> send(int to, Message message,
                       std::optional<std::chrono::milliseconds> timeout = std::nullopt) override;
  const WorkerInfo& self() const override;
  absl::StatusOr<WorkerInfo> worker_info(std::string_view name) const override;
  absl::StatusOr<WorkerInfo> worker_info(int id) const override;
  std::vector<WorkerInfo> worker_infos() const override;
  std::chrono::milliseconds default_timeout() const override;
  absl::Status join(std::chrono::milliseconds timeout) override;
  absl::Status sync(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void add_membership_listener(MembershipListener listener) override;
  std::map<std::string, std::string> debug_info() const override;

 private:
  ProcessGroupAgent(std::shared_ptr<internal::AgentCore> core, internal::ProcessGroupTransport* transport);
  std::shared_ptr<internal::AgentCore> core_;
  internal::ProcessGroupTransport* transport_;  // owned by core_
};

}  // namespace ferry
