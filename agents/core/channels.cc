#include "agents/core/channels.h"

#include <algorithm>

#include "agents/core/buffer_pool.h"
#include "base/status.h"
#include "tensor/cuda.h"

namespace ferry::internal {
namespace {

const DeviceMap* map_towards(const DeviceMaps& maps, const std::string& peer) {
  auto it = maps.find(peer);
  return it == maps.end() ? nullptr : &it->second;
}

// The local devices a worker's maps name, when it listed none itself.
std::vector<Device> devices_of(const DeviceMaps& maps, const DeviceMaps& reverse) {
  std::vector<Device> out;
  auto add = [&](Device d) {
    if (!d.is_cpu() && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& [peer, map] : maps) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  // A reverse map is keyed by this worker's devices too: {mine -> the caller's}.
  for (const auto& [peer, map] : reverse) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  return out;
}

// A worker that handles CUDA devices receives into page-locked memory: the staging
// channel lands chunks from it on the transport thread (see pin_receive_buffers).
void pin_if_cuda(const std::vector<Device>& handled) {
  if (handled.empty()) return;
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  if (runtime->device_count() > 0) pin_receive_buffers(std::move(runtime));
}

}  // namespace

Channels::Channels(std::vector<std::shared_ptr<DeviceChannel>> channels, DeviceMaps device_maps,
                   DeviceMaps reverse_device_maps, const std::vector<Device>& devices)
    : channels_(std::move(channels)),
      staging_(std::make_shared<CudaStaging>(devices.empty() ? devices_of(device_maps, reverse_device_maps)
                                                             : devices)),
      device_maps_(std::make_shared<const DeviceMaps>(std::move(device_maps))),
      reverse_device_maps_(std::make_shared<const DeviceMaps>(std::move(reverse_device_maps))) {
  pin_if_cuda(staging_->devices());
}

DeviceChannel& Channels::for_peer(const PeerAddress& peer) {
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    if (channel->reaches(peer.address)) return *channel;
  }
  return *staging_;
}

absl::Status Channels::stage_request(const PeerAddress& peer, std::vector<Tensor>& tensors,
                                     std::vector<std::string>& targets, WriteAhead write_ahead) {
  std::shared_ptr<const DeviceMaps> maps = device_maps_.load();
  return for_peer(peer).stage_outgoing(tensors, targets, map_towards(*maps, peer.info.name), peer.info.name,
                                       write_ahead);
}

absl::Status Channels::stage_reply(const PeerAddress* member, const std::string& caller, std::vector<Tensor>& tensors,
                                   std::vector<std::string>& targets, WriteAhead write_ahead) {
  std::shared_ptr<const DeviceMaps> reverse = reverse_device_maps_.load();
  DeviceChannel& channel = member == nullptr ? *staging_ : for_peer(*member);
  return channel.stage_outgoing(tensors, targets, map_towards(*reverse, caller), caller, write_ahead);
}

absl::Status Channels::land(std::vector<Tensor>& tensors, const std::vector<std::string>& targets) {
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    FERRY_RETURN_IF_ERROR(channel->land_incoming(tensors, targets));
  }
  return staging_->land_incoming(tensors, targets);
}

void Channels::set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices) {
  std::vector<Device> handled = devices.empty() ? devices_of(device_maps, reverse_device_maps) : std::move(devices);
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) channel->set_devices(handled);
  pin_if_cuda(handled);
  staging_->set_devices(std::move(handled));
  device_maps_.store(std::make_shared<const DeviceMaps>(std::move(device_maps)));
  reverse_device_maps_.store(std::make_shared<const DeviceMaps>(std::move(reverse_device_maps)));
}

void Channels::debug_info(std::map<std::string, std::string>& info) const {
  for (const auto& [key, value] : staging_->debug_info()) info[key] = value;
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    for (const auto& [key, value] : channel->debug_info()) info[key] = value;
  }
}

}  // namespace ferry::internal
