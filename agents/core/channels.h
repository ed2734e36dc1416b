// File: agents/core/channels.h
//
// Channels: the device channels of one agent (agents/core/device_channel.h) and the
// device maps they follow. It picks the channel tensors to a peer take (the first of
// AgentOptions::device_channels that reaches the peer, else staging through host
// memory: the one place that choice is made), stages a request's tensors through the
// device map towards the callee and a reply's through the reverse map towards the
// caller, and lands what arrives. It calls only the channels.
//
// It also serves the channels that move bytes themselves (ChannelPort): descriptors
// peers pass are held here, bounded, until a message of that authenticated peer asks
// for them; notices go to and come from the channels by name. It counts, per peer,
// which channel each device tensor took (debug_info, prometheus), and enforces
// AgentOptions::device_channel and device_channel_by_peer.
//
// Threads: any; a dynamic group's set_device_maps may run beside calls, which then
// see either the old maps or the new ones.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "agents/core/cuda_staging.h"
#include "agents/core/device_channel.h"
#include "agents/core/membership.h"
#include "base/shared_slot.h"
#include "device_maps/device_map.h"

namespace ferry::internal {

class Channels final : public ChannelPort {
 public:
  // `devices` empty: those the maps name. `required`: AgentOptions::device_channel;
  // `required_by_peer`: AgentOptions::device_channel_by_peer, which takes its place
  // towards the peers it names.
  Channels(std::vector<std::shared_ptr<DeviceChannel>> channels, DeviceMaps device_maps,
           DeviceMaps reverse_device_maps, const std::vector<Device>& devices, std::string required = "",
           std::map<std::string, std::string> required_by_peer = {});

  // What the agent does for ChannelPort, given once before any call: pass a
  // descriptor to a member, write a message to a member, resolve a name.
  struct Core {
    int self_id = -1;
    std::function<absl::Status(int peer, uint64_t tag, int fd, std::string_view note)> pass_descriptor;
    std::function<void(int peer, Wire wire)> write;
    std::function<int(std::string_view name)> peer_id;
  };
  void attach(Core core);

  // The channel tensors to `peer` take. With a required channel that does not reach
  // it, an error saying why.
  DeviceChannel& for_peer(const PeerAddress& peer);
  absl::StatusOr<DeviceChannel*> choose(const PeerAddress& peer);
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
  // A lost peer's unfinished chunked tensors, and what other channels hold for it, are
  // dropped.
  void forget(int peer);
  // A kNotice message from worker `peer`, for the channel it names.
  void on_notice(int peer, const Wire& wire);
  // A descriptor a peer passed on `connection` (TransportEvents::on_descriptor), held
  // until taken, at most kMaxHeldPerConnection per connection; and those of a
  // connection that ended, closed.
  void on_descriptor(const std::shared_ptr<Connection>& connection, uint64_t tag, int fd, std::string note);
  void drop_descriptors(const Connection* connection);
  static constexpr size_t kMaxHeldPerConnection = 16;
  // Whether landing `targets`, or handling notice `wire` from `peer`, may wait for a
  // descriptor (DeviceChannel::awaits_descriptor): then not on a transport's thread.
  bool awaits_descriptor(const std::vector<std::string>& targets) const;
  bool notice_awaits_descriptor(int peer, const Wire& wire) const;
  // Counters of staging and of the channel each device tensor took, per peer, as
  // Prometheus series: CudaStaging::prometheus's, and
  //   ferry_device_tensors_total{peer, channel}
  std::function<std::string()> prometheus() const;

  // ChannelPort.
  int self_id() const override { return core_.self_id; }
  int peer_id(std::string_view peer) const override { return core_.peer_id ? core_.peer_id(peer) : -1; }
  absl::Status pass_descriptor(int peer, uint64_t tag, int fd, std::string_view note) override;
  absl::StatusOr<PassedDescriptor> take_descriptor(int peer, uint64_t tag, std::chrono::milliseconds wait) override
      ABSL_LOCKS_EXCLUDED(held_mu_);
  void notify(int peer, std::string_view channel, std::string payload) override;
  const std::string& required_channel() const override { return required_; }
  std::string required_channel_to(std::string_view peer) const override;
  DeviceChannel& staging() override { return *staging_; }
  // Dynamic groups: the maps and devices change as workers join.
  void set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices);
  void debug_info(std::map<std::string, std::string>& info) const;

 private:
  // The channel notice `wire` is for (null: none of this worker's), its name and payload.
  DeviceChannel* notice_channel(const Wire& wire, std::string_view& name, std::string_view& payload) const;
  // Counts the channel of every device tensor of a message staged for `peer`.
  void count(const std::string& peer, const std::vector<std::string>& targets);

  struct Held {
    std::weak_ptr<Connection> from;
    const Connection* key = nullptr;
    PassedDescriptor passed;
  };
  // Device tensors by (peer, channel), shared with the metrics endpoint.
  struct Counts {
    absl::Mutex mu;
    std::map<std::pair<std::string, std::string>, uint64_t> by_peer ABSL_GUARDED_BY(mu);
  };

  const std::vector<std::shared_ptr<DeviceChannel>> channels_;
  const std::shared_ptr<CudaStaging> staging_;
  const std::string required_;
  Core core_;  // set once by attach(), before any call
  const std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
  absl::Mutex held_mu_;
  absl::CondVar held_cv_;
  std::map<uint64_t, Held> held_ ABSL_GUARDED_BY(held_mu_);  // by tag
  SharedSlot<const DeviceMaps> device_maps_;
  SharedSlot<const DeviceMaps> reverse_device_maps_;
  const std::map<std::string, std::string> required_by_peer_;  // by peer name
};

}  // namespace ferry::internal
