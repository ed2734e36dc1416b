// File: backends/process_group/process_group_backend.h
//
// The PROCESS_GROUP backend (seed 003): RPC over a ferry ProcessGroup's byte messages
// (Gloo over TCP), for hosts where TensorPipe's transports do not work or that may open
// only one kind of TCP connection. Its init handler follows the seed — process group,
// agent, barrier — plus the device-map steps of DESIGN.md, so CUDA tensors route through
// the same maps as on TENSORPIPE:
//   1. the process group over the store (a rank or world size that does not match the
//      other ranks' fails there);
//   2. an all-gather, over the group, of every worker's name and device info (and any
//      local failure, so every worker fails together, naming the one at fault);
//   3. device-map validation, reverse maps and device list;
//   4. the agent over the group (ProcessGroupAgent), every rank a member;
//   5. an all-gather of "agent started or why not", which is also the barrier.
//
//   ProcessGroupRpcBackendOptions options;
//   options.num_send_recv_threads = 8;
//   ferry::init_rpc("worker0", ferry::BackendType::PROCESS_GROUP, rank, world_size, options);
#pragma once

#include <concepts>
#include <string>
#include <vector>

#include "backends/backend_registry.h"
#include "device_maps/options.h"

namespace ferry {

// Thread-compatible.
class ProcessGroupRpcBackendOptions final : public RpcBackendOptions {
 public:
  static constexpr int kDefaultNumSendRecvThreads = 4;
  std::string backend_name() const override { return BackendType::PROCESS_GROUP.name; }

  // Sender threads, and the threads that run requests and continuations: [1, 4096].
  int num_send_recv_threads = kDefaultNumSendRecvThreads;

  // Where this worker's CUDA tensors land on `worker` (device_maps/options.h).
  [[nodiscard]] absl::Status set_device_map(std::string_view worker, const DeviceMapSpec& map) {
    return device_map_options_.set_device_map(worker, map);
  }
  template <typename Map>
    requires std::same_as<Map, DeviceMap>
  [[nodiscard]] absl::Status set_device_map(std::string_view worker, const Map& map) {
    return device_map_options_.set_device_map(worker, map);
  }
  [[nodiscard]] absl::Status set_devices(const std::vector<DeviceSpec>& devices) {
    return device_map_options_.set_devices(devices);
  }
  const DeviceMaps& device_maps() const { return device_map_options_.device_maps(); }
  const std::vector<Device>& devices() const { return device_map_options_.devices(); }

  // kInvalidArgument, saying what was expected: num_send_recv_threads out of range, a
  // negative rpc_timeout.
  absl::Status validate() const;

 private:
  DeviceMapOptions device_map_options_;
};

// PROCESS_GROUP's options constructor. Keyword arguments: num_send_recv_threads
// (int64), device_maps (DeviceMaps), devices (vector<Device>). Errors
// (kInvalidArgument): an unknown key (named, with the known ones), a value of the wrong
// type (naming the key and both types), a value validate() refuses.
absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_process_group_options(
    std::chrono::milliseconds rpc_timeout, const std::string& init_method, const Kwargs& kwargs);

// PROCESS_GROUP's init handler (static groups only: kUnimplemented without a world
// size, since a process group cannot grow).
absl::StatusOr<std::shared_ptr<RpcAgent>> init_process_group_backend(const BackendInitArgs& args);

}  // namespace ferry
