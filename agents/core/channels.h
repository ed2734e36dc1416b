// File: agents/core/channels.h
//
// Channels: the device channels of one agent (agents/core/device_channel.h) and the
// device maps they follow. It picks the channel tensors to a peer take (the first of
// AgentOptions::device_channels that reaches the peer, else staging through host
// memory: the one place that choice is made), stages a request's tensors through the
// device map towards the callee and a reply's through the reverse map towards the
// caller, and lands what arrives. It calls only the channels.
//
// Threads: any; a dynamic group's set_device_maps may run beside calls, which then
// see either the old maps or the new ones.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "agents/core/cuda_staging.h"
#include "agents/core/device_channel.h"
#include "agents/core/membership.h"
#include "base/shared_slot.h"
#include "device_maps/device_map.h"

namespace ferry::internal {

class Channels {
 public:
  // `devices` empty: those the maps name.
  Channels(std::vector<std::shared_ptr<DeviceChannel>> channels, DeviceMaps device_maps,
           DeviceMaps reverse_device_maps, const std::vector<Device>& devices);

  // The channel tensors to `peer` take.
  DeviceChannel& for_peer(const PeerAddress& peer);
  // A request's tensors towards `peer`, through this worker's device map. `write_ahead`
  // writes what must precede the request on its connection (a large tensor's chunks).
  absl::Status stage_request(const PeerAddress& peer, std::vector<Tensor>& tensors, std::vector<std::string>& targets,
                             WriteAhead write_ahead);
  // A reply's tensors back to `caller` (`member`: its entry, null for a caller not in
  // the table, whose tensors go through staging), through the reverse maps.
  absl::Status stage_reply(const PeerAddress* member, const std::string& caller, std::vector<Tensor>& tensors,
                           std::vector<std::string>& targets, WriteAhead write_ahead);
  // Lands tensors whose targets name a device, on a pool thread (or the receiving
  // thread, for at most kLandInlineBytes of them).
  absl::Status land(std::vector<Tensor>& tensors, const std::vector<std::string>& targets);
  // On the receiving transport thread, in the connection's order: a chunk of a large
  // tensor from worker `peer`, and a message that may name chunked tensors (swapped
  // for the landed ones). Errors mean the peer broke the protocol: close its connection.
  absl::Status land_chunk(int peer, Wire wire) { return staging_->land_chunk(peer, std::move(wire)); }
  absl::Status claim_chunked(int peer, Wire& wire) {
    return CudaStaging::names_chunked(wire.targets) ? staging_->claim_chunked(peer, wire) : absl::OkStatus();
  }
  // The staging channel, for its counters (CudaStaging::prometheus).
  std::shared_ptr<const CudaStaging> staging() const { return staging_; }
  // A lost peer's unfinished chunked tensors are dropped.
  void forget(int peer) { staging_->forget(peer); }
  // Dynamic groups: the maps and devices change as workers join.
  void set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices);
  void debug_info(std::map<std::string, std::string>& info) const;

 private:
  const std::vector<std::shared_ptr<DeviceChannel>> channels_;
  const std::shared_ptr<CudaStaging> staging_;
  SharedSlot<const DeviceMaps> device_maps_;
  SharedSlot<const DeviceMaps> reverse_device_maps_;
};

}  // namespace ferry::internal
