// File: agents/internal/transport.h
//
// What an agent needs from a transport, and nothing more: listen and hand back an
// address to publish; send a request to a member (opening the connection on first
// use); send a reply back the way a request came; deliver what it reads; close. The
// agent core (agent_core.h) does everything else — call ids, deadlines, serving,
// membership, device staging, shutdown — so a new backend is one adapter.
//
// Threads: a transport delivers events on its own threads ("transport threads"),
// marked with TransportThreadScope; events must not block. Its methods may be called
// from any thread.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace ferry::internal {

// One message as it crosses a transport: the sealed Message buffer, its tensors (in
// host memory), and for each tensor the device it must land on ("" for CPU).
struct Wire {
  std::string metadata;
  std::vector<Tensor> tensors;
  std::vector<std::string> targets;
};

// The way back to the worker that sent a request. Thread-safe.
class ReplyPath {
 public:
  virtual ~ReplyPath() = default;
  // Sends the reply; a failure is logged (the caller learns of it by losing us).
  virtual void reply(Wire wire) = 0;
  // The name the caller gave for itself ("" when unknown).
  virtual const std::string& caller() const = 0;
  // Drops the connection (the caller sent something unreadable).
  virtual void close() = 0;
};

// Implemented by the agent core. Called on transport threads; must not block.
class TransportEvents {
 public:
  virtual ~TransportEvents() = default;
  // A request (or ping) arrived; `wire` is an error when it could not be read whole.
  virtual void on_request(std::shared_ptr<ReplyPath> from, absl::StatusOr<Wire> wire) = 0;
  // A reply arrived from member `peer` on the connection our requests go out on.
  virtual void on_reply(int peer, Wire wire) = 0;
  // The connection to member `peer` failed: every call to it is lost. `why` says how.
  virtual void on_peer_lost(int peer, absl::Status why) = 0;
};

// Thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  // Starts listening, delivering events to `events` while it lives (a weak reference,
  // locked per event, so the agent may die on a transport thread). Returns the
  // address record peers need to reach this worker.
  virtual absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) = 0;
  // Sends a request to member `peer`, connecting to `address` on first use. A write
  // that fails, or a connection that cannot be made, ends in on_peer_lost(peer).
  virtual void send(int peer, const std::string& peer_name, const std::string& address, Wire wire) = 0;
  // Closes the connection to `peer` (it left); a later send connects anew.
  virtual void disconnect(int peer) = 0;
  // Stops listening and closes every connection; when it returns, no event is being
  // delivered or will be. Idempotent. Not from a transport thread.
  virtual void close() = 0;
  // Counters and settings for debug_info(): "transports", "channels", "pipes", ...
  virtual std::map<std::string, std::string> debug_info() const = 0;
};

}  // namespace ferry::internal
