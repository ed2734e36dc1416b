// File: backends/tensorpipe/tensorpipe_backend.h
//
// The TENSORPIPE backend: its options type, its options constructor and its init
// handler, which runs the static-group steps of DESIGN.md ("TENSORPIPE init handler")
// over the store: an all-gather of every worker's device info and host, device-map
// validation, reverse maps and device list, the agent (listening), an all-gather of
// the agents' addresses that doubles as the barrier. No pipe opens during init: each
// opens on the first call between two workers.
//
//   TensorPipeRpcBackendOptions options;
//   options.num_worker_threads = 8;
//   FERRY_RETURN_IF_ERROR(options.set_device_map("worker1", {{0, 1}}));   // cuda:0 -> cuda:1
#pragma once

#include <concepts>
#include <optional>
#include <string>
#include <vector>

#include "agents/tensorpipe/factory.h"
#include "backends/backend_registry.h"
#include "device_maps/options.h"

namespace ferry {

// Thread-compatible. The agent's own settings (num_worker_threads, transports,
// channels; see agents/tensorpipe/factory.h) are embedded, and checked by their
// validate() when the options are constructed and again at init.
class TensorPipeRpcBackendOptions final : public RpcBackendOptions, public TensorPipeAgentSettings {
 public:
  std::string backend_name() const override { return BackendType::TENSORPIPE.name; }

  // Where this worker's CUDA tensors land on `worker`; merged into what is there (see
  // device_maps/options.h for the errors).
  [[nodiscard]] absl::Status set_device_map(std::string_view worker, const DeviceMapSpec& map) {
    return device_map_options_.set_device_map(worker, map);
  }
  // A template only so that a braced list such as {{Device::cuda(0), Device::cuda(1)}}
  // is not ambiguous between the two overloads (as in device_maps/options.h).
  template <typename Map>
    requires std::same_as<Map, DeviceMap>
  [[nodiscard]] absl::Status set_device_map(std::string_view worker, const Map& map) {
    return device_map_options_.set_device_map(worker, map);
  }
  // The devices this worker's agent handles (default: those its maps name).
  [[nodiscard]] absl::Status set_devices(const std::vector<DeviceSpec>& devices) {
    return device_map_options_.set_devices(devices);
  }
  const DeviceMaps& device_maps() const { return device_map_options_.device_maps(); }
  const std::vector<Device>& devices() const { return device_map_options_.devices(); }

 private:
  DeviceMapOptions device_map_options_;
};

// TENSORPIPE's options constructor. Keyword arguments: num_worker_threads (int64),
// transports, channels (vector<string>), device_maps (DeviceMaps), devices
// (vector<Device>), heartbeat_interval_ms (int64), auth_token (string; unset: the
// agent reads FERRY_AUTH_TOKEN). Errors (kInvalidArgument): an unknown key (named, with the known
// ones), a value of the wrong type, settings that TensorPipeAgentSettings::validate()
// refuses.
absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_tensorpipe_options(std::chrono::milliseconds rpc_timeout,
                                                                                const std::string& init_method,
                                                                                const Kwargs& kwargs);

// TENSORPIPE's init handler (static groups: world_size > 0). When any worker fails a
// step, every worker fails with the same error, naming the worker at fault.
absl::StatusOr<std::shared_ptr<RpcAgent>> init_tensorpipe_backend(const BackendInitArgs& args);

}  // namespace ferry
