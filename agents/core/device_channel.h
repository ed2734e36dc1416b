// File: agents/core/device_channel.h
//
// DeviceChannel: how a device (CUDA) tensor crosses to one peer. The agent core picks
// one channel per peer (Agent::channel_for, the one place that choice is made) and
// runs it on every device tensor of a request (through the device map towards the
// callee) and of a reply (through the reverse map towards the caller).
//
// A channel either replaces a device tensor by host bytes the transport carries (the
// staging channel, agents/core/cuda_staging.h: pinned host memory, across hosts and as
// the fallback), or leaves a descriptor in the tensor's target and moves the bytes
// itself (a CUDA IPC channel on one host). A target is "" for a CPU tensor, the landing
// device ("cuda:1") for staged bytes, or "<channel>|<descriptor>" for a channel that
// moves bytes itself, so that the receiver knows which channel lands it.
//
//   std::vector<std::string> targets;
//   FERRY_RETURN_IF_ERROR(channel.stage_outgoing(tensors, targets, &map, "worker1"));
//   ... the transport carries tensors and targets ...
//   FERRY_RETURN_IF_ERROR(channel.land_incoming(tensors, targets));   // on the receiver
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/core/transport.h"
#include "device_maps/device_map.h"
#include "tensor/device.h"
#include "tensor/tensor.h"

namespace ferry {

// Writes a message on the connection the staged message will take, ahead of it: a
// channel streams a large tensor as pieces written while it copies the next ones.
using WriteAhead = absl::FunctionRef<void(Wire)>;

class DeviceChannel;

// A descriptor a peer passed (Connection::pass_descriptor) and its note; the fd is
// owned by whoever holds this (-1: none came).
struct PassedDescriptor {
  int fd = -1;
  std::string note;
};

// What the agent core offers a channel that moves bytes itself (a CUDA IPC channel):
// descriptors and notices to and from its counterpart in a peer. Thread-safe;
// implemented by the core (agents/core/channels.h), which outlives the channel's use
// of it.
class ChannelPort {
 public:
  virtual ~ChannelPort() = default;
  // This worker's id, and the id of the member named `peer` (-1: none).
  virtual int self_id() const = 0;
  virtual int peer_id(std::string_view peer) const = 0;
  // Passes descriptor `fd` (borrowed) and `note` to worker `peer` on the connection its
  // messages take, opened if need be, ahead of every message written after this
  // returns. Errors: the peer is unknown; its connection cannot pass descriptors
  // (kUnimplemented, naming the transport's reason).
  virtual absl::Status pass_descriptor(int peer, uint64_t tag, int fd, std::string_view note) = 0;
  // What worker `peer` passed with `tag`, now the caller's, waiting up to `wait` for it
  // (it is on its way when a message naming it came, or the connection it came on is
  // still in its handshake). Errors (kNotFound): nothing came with that tag from that
  // peer, on a connection it authenticated, in time.
  virtual absl::StatusOr<PassedDescriptor> take_descriptor(int peer, uint64_t tag, std::chrono::milliseconds wait) = 0;
  // Sends `payload` to the channel of the same name() in worker `peer` (its
  // on_notice), behind what was written to it before. Dropped when the peer is gone.
  virtual void notify(int peer, std::string_view channel, std::string payload) = 0;
  // The channel required for every device tensor (AgentOptions::device_channel; ""
  // none), and the staging channel, which a channel hands a message it cannot move.
  virtual const std::string& required_channel() const = 0;
  // The channel required for device tensors to worker `peer` (by name): its entry in
  // AgentOptions::device_channel_by_peer, else required_channel().
  virtual std::string required_channel_to(std::string_view peer) const {
    (void)peer;
    return required_channel();
  }
  virtual DeviceChannel& staging() = 0;
};

// Thread-safe: calls for different messages run concurrently.
class DeviceChannel {
 public:
  virtual ~DeviceChannel() = default;
  // Short and unique among a worker's channels: "staging", "cuda_ipc".
  virtual std::string_view name() const = 0;
  // Whether this channel can move tensors to the worker at `peer_address` (its
  // transport's address record): same host, what both sides support, ...
  virtual bool reaches(const std::string& peer_address) const = 0;
  // Why reaches(peer_address) is false, in words for an error: "another host", ...
  virtual std::string why_not(const std::string& peer_address) const {
    (void)peer_address;
    return "the channel does not reach it";
  }
  // The core's services (above), given once before any other call; a channel that
  // needs none ignores them.
  virtual void attach(ChannelPort* port) { (void)port; }
  // A notice from this channel's counterpart in worker `peer` (ChannelPort::notify),
  // on the transport thread that received it (on a pool thread when
  // notice_awaits_descriptor): it must not block. An error closes nothing; it is logged.
  virtual absl::Status on_notice(int peer, std::string_view payload) {
    (void)peer, (void)payload;
    return absl::OkStatus();
  }
  // Whether land_incoming(targets), or on_notice(peer, payload), may wait for a
  // descriptor the peer passed and this worker has not taken yet
  // (ChannelPort::take_descriptor): the core then runs it on its pool, never on a
  // transport's thread, which may have to run the handshake of the connection the
  // descriptor came on. Any thread.
  virtual bool awaits_descriptor(const std::vector<std::string>& targets) const {
    (void)targets;
    return false;
  }
  virtual bool notice_awaits_descriptor(int peer, std::string_view payload) const {
    (void)peer, (void)payload;
    return false;
  }
  // Worker `peer` was lost: drop what is held for it.
  virtual void forget(int peer) { (void)peer; }

  // Makes every device tensor of `tensors` ready to travel to `peer` and sets
  // targets[i] (resized to tensors.size(); "" for CPU tensors). `map` (null: none) maps
  // this worker's devices to the peer's. Called on user or pool threads, never a
  // transport thread. Errors, before anything is sent: a device tensor with no entry in
  // the map or on a device this worker does not handle, naming it and the peer.
  // `write_ahead` writes messages that must reach the peer before this one (called on
  // this thread, before stage_outgoing returns).
  virtual absl::Status stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets,
                                      const DeviceMap* map, std::string_view peer, WriteAhead write_ahead) = 0;
  // Lands every tensor whose target is this channel's on its device; the tensors are
  // usable on the device's default stream when it returns. Called on a pool thread, or
  // on a transport thread for a message whose device tensors total at most
  // kLandInlineBytes, so it must not wait for copies.
  virtual absl::Status land_incoming(std::vector<Tensor>& tensors, const std::vector<std::string>& targets) = 0;

  // Dynamic groups: the devices this worker handles change as workers join.
  virtual void set_devices(std::vector<Device> devices) = 0;
  // Counters for debug_info(), each key prefixed with the channel's name.
  virtual std::map<std::string, std::string> debug_info() const = 0;
};

// A message whose device tensors total at most this many bytes lands on the thread that
// received it: a hand-off to the pool would cost more than its copies.
inline constexpr size_t kLandInlineBytes = size_t{64} << 10;

// Whether any target names a device (some tensor needs a channel to land).
inline bool any_device_target(const std::vector<std::string>& targets) {
  for (const std::string& t : targets) {
    if (!t.empty()) return true;
  }
  return false;
}

// The bytes of the tensors whose targets name a device.
inline size_t device_bytes(const Wire& wire) {
  size_t bytes = 0;
  for (size_t i = 0; i < wire.targets.size() && i < wire.tensors.size(); ++i) {
    if (!wire.targets[i].empty()) bytes += wire.tensors[i].nbytes();
  }
  return bytes;
}

// The channel a target belongs to: the part before '|', or "staging" for a bare device.
inline std::string_view channel_of_target(std::string_view target) {
  size_t bar = target.find('|');
  return bar == std::string_view::npos ? std::string_view("staging") : target.substr(0, bar);
}

}  // namespace ferry
