// File: agents/process_group/transport.h
//
// The process-group adapter under ProcessGroupAgent (agents/process_group/factory.h):
// messages travel as byte messages of a ferry ProcessGroup (process_group.h:
// send_bytes / recv_bytes, over Gloo's TCP pairs), on a tag of their own. The group's
// connections are made once, when the group is created, so there is nothing to open
// on first use; an address record is just "pg:<rank>".
//
// A message is one frame (see process_group_transport.cc): a fixed header, the sender's
// name, a table of tensor lengths and device targets, the sealed Message, then each
// tensor's bytes at a 64-byte aligned offset. Received tensors are views into the
// received frame (no copy); sending copies the tensors into the frame once.
//
// Threads (all transport threads): one receiver per other rank, which receives from
// that rank only — Gloo fails a receive posted on one peer's connection when that
// connection breaks, but never tells a receive from any source, so per-peer receivers
// are what lets a lost peer fail its calls at once — and, per other rank, a queue and
// `sender_threads` senders that take frames from it and wait until the receiver
// has them. Sends carry no Gloo timeout (one would break the group for every rank): a
// rank that stops reading holds up only its own senders, until the core closes its link
// (its heartbeat declared it lost) or close() gives up on them (ProcessGroup::cancel_sends).
//
// Connections: a Link is one way of a rank pair (our requests and its replies, or its
// requests and our replies) over the group's one connection to that rank; a request
// frame from a rank with no open incoming Link starts one (on_accepted). The mesh is
// fixed when the group is created, so connects_on_demand() is false.
//
// Departures: the group's connections outlive every Link, so the end of a rank is told
// by what comes on its connection. A rank that closes says goodbye after everything it
// sent; on the goodbye, its Links both ways end (on_closed, once each) with kUnavailable
// `worker "w1" (rank 1) shut down: it said goodbye`, after the frames that came before
// it were delivered (a call it answered is not failed), and the core reports the
// worker left (once join() saw every worker arrive) or lost. A rank that dies without
// a goodbye breaks the group's connection to it: its receive fails and its Links end
// with kUnavailable. A goodbye that comes while this transport closes reports nothing.
// A goodbye is for good, since that rank's group is shut down: connect() to it
// afterwards returns a Link that has already ended (on_closed inline, kUnavailable,
// "said goodbye earlier"), and queues nothing.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "agents/core/transport.h"
#include "process_group/process_group.h"

namespace ferry::internal {

// The tag the agent's messages use on its process group.
inline constexpr uint32_t kProcessGroupAgentTag = 0x46525043;  // "FRPC"

// "pg:<rank>" for `rank`, and back. kInvalidArgument for a record that is not one.
std::string process_group_address(int rank);
absl::StatusOr<int> rank_of_process_group_address(const std::string& address);

class ProcessGroupTransport final : public Transport {
 public:
  // Worker `name` over `group` (shared: close() shuts it down, since that is the only
  // way to end a Gloo receive), with `sender_threads` senders (the agent's
  // num_worker_threads). Errors: a null group, a non-member handle, sender_threads < 1.
  static absl::StatusOr<std::unique_ptr<ProcessGroupTransport>> create(std::string name,
                                                                       std::shared_ptr<ProcessGroup> group,
                                                                       int sender_threads);
  ~ProcessGroupTransport() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  // Closing an outgoing Link drops the frames queued for its rank, and the sends to it
  // in flight return (their messages stay posted in Gloo); the group's connection
  // outlives it, and a later connect() to the same rank goes out as usual, unless that
  // rank said goodbye: then the Link ends before connect() returns (kUnavailable).
  std::shared_ptr<Connection> connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                      const std::string& address) override;
  bool connects_on_demand() const override { return false; }
  // Sends what is queued, says goodbye to every rank that has not said goodbye to us
  // (each of them then ends its Links with this rank, see Departures above), then shuts
  // the group down and joins its threads.
  // A rank that does not drain is given up on after the group's timeout (its goodbye
  // after at most 5 s).
  void close() override;
  std::map<std::string, std::string> debug_info() const override;

  ProcessGroup& group();

  struct State;

 private:
  explicit ProcessGroupTransport(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace ferry::internal
