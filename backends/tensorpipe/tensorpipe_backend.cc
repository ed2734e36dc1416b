#include "backends/tensorpipe/tensorpipe_backend.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/tensorpipe_agent.h"
#include "base/logging.h"
#include "base/status.h"
#include "cereal/types/string.hpp"
#include "device_maps/validate.h"
#include "process_group/process_group.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

constexpr const char* kKnownKwargs[] = {"num_worker_threads", "transports", "channels", "device_maps", "devices"};

template <typename T>
absl::StatusOr<T> kwarg_as(const std::string& key, const KwargValue& value, const char* expected) {
  if (const T* v = std::get_if<T>(&value)) return *v;
  return absl::InvalidArgumentError(absl::StrCat("TENSORPIPE option \"", key, "\" must be ", expected, ", got ",
                                                 kwarg_type_name(value)));
}

// What each worker contributes to the all-gather of step 2: its device info, and
// whatever already failed locally, so that every worker fails together.
struct InitRecord {
  WorkerDeviceInfo info;
  std::string error;  // empty: fine
  int32_t code = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(info, error, code);
  }
};

absl::Status check_agent_options(const TensorPipeRpcBackendOptions& o) {
  if (o.num_worker_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_worker_threads must be at least 1, got ", o.num_worker_threads));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_tensorpipe_options(std::chrono::milliseconds rpc_timeout,
                                                                                const std::string& init_method,
                                                                                const Kwargs& kwargs) {
  auto options = std::make_unique<TensorPipeRpcBackendOptions>();
  options->rpc_timeout = rpc_timeout;
  options->init_method = init_method;
  for (const auto& [key, value] : kwargs) {
    if (key == "num_worker_threads") {
      FERRY_ASSIGN_OR_RETURN(int64_t n, kwarg_as<int64_t>(key, value, "int64"));
      if (n < 1 || n > 4096) {
        return absl::InvalidArgumentError(absl::StrCat("num_worker_threads must be in [1, 4096], got ", n));
      }
      options->num_worker_threads = static_cast<int>(n);
    } else if (key == "transports") {
      FERRY_ASSIGN_OR_RETURN(options->transports, kwarg_as<std::vector<std::string>>(key, value, "vector<string>"));
    } else if (key == "channels") {
      FERRY_ASSIGN_OR_RETURN(options->channels, kwarg_as<std::vector<std::string>>(key, value, "vector<string>"));
    } else if (key == "device_maps") {
      FERRY_ASSIGN_OR_RETURN(DeviceMaps maps, kwarg_as<DeviceMaps>(key, value, "device maps"));
      for (const auto& [worker, map] : maps) FERRY_RETURN_IF_ERROR(options->set_device_map(worker, map));
    } else if (key == "devices") {
      FERRY_ASSIGN_OR_RETURN(std::vector<Device> devices, kwarg_as<std::vector<Device>>(key, value, "vector<Device>"));
      FERRY_RETURN_IF_ERROR(options->set_devices(std::vector<DeviceSpec>(devices.begin(), devices.end())));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("TENSORPIPE backend has no option \"", key,
                                                     "\" (expected one of: ", absl::StrJoin(kKnownKwargs, ", "),
                                                     ")"));
    }
  }
  return options;
}

absl::StatusOr<std::shared_ptr<RpcAgent>> init_tensorpipe_backend(const BackendInitArgs& args) {
  const auto* options = dynamic_cast<const TensorPipeRpcBackendOptions*>(&args.options);
  if (options == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("TENSORPIPE backend got options of backend ",
                                                   args.options.backend_name()));
  }
  if (args.world_size <= 0) {
    return absl::UnimplementedError("TENSORPIPE: dynamic groups (no world size) are not supported yet");
  }
  std::chrono::milliseconds init_timeout =
      options->rpc_timeout.count() > 0 ? options->rpc_timeout : std::chrono::milliseconds(std::chrono::minutes(5));

  // Step 1: a process group over the store.
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> group,
                         ProcessGroup::create(args.store, args.rank, args.world_size, init_timeout));

  // Step 2: every worker's device info (and any local failure so far).
  InitRecord mine;
  mine.info.name = args.name;
  mine.info.device_count = cuda_runtime()->device_count();
  mine.info.device_maps = options->device_maps();
  mine.info.devices = options->devices();
  if (absl::Status s = check_agent_options(*options); !s.ok()) {
    mine.error = std::string(s.message());
    mine.code = static_cast<int32_t>(s.code());
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<InitRecord> all, group->all_gather_object(mine));
  std::vector<WorkerDeviceInfo> infos;
  for (const InitRecord& r : all) {
    if (!r.error.empty()) {
      return absl::Status(static_cast<absl::StatusCode>(r.code),
                          absl::StrCat("init_rpc failed on worker \"", r.info.name, "\": ", r.error));
    }
    infos.push_back(r.info);
  }

  // Steps 3-5: validate every worker's maps (deterministic, so every worker reaches the
  // same verdict), then my reverse maps and device list.
  FERRY_ASSIGN_OR_RETURN(DeviceSetup setup, setup_devices(args.name, infos, /*is_static_group=*/true));

  // Step 6: the agent.
  TensorPipeAgentOptions agent_options;
  agent_options.num_worker_threads = options->num_worker_threads;
  agent_options.rpc_timeout = options->rpc_timeout;
  agent_options.init_timeout = init_timeout;
  agent_options.transports = options->transports;
  agent_options.channels = options->channels;
  agent_options.device_maps = options->device_maps();
  agent_options.reverse_device_maps = setup.reverse_device_maps;
  agent_options.devices = setup.devices;
  absl::StatusOr<std::shared_ptr<TensorPipeAgent>> agent =
      TensorPipeAgent::create(args.store, args.name, args.rank, args.world_size, agent_options, args.handler);

  // Everyone learns whether everyone's agent started, so none waits for a dead peer.
  InitRecord started;
  started.info.name = args.name;
  if (!agent.ok()) {
    started.error = std::string(agent.status().message());
    started.code = static_cast<int32_t>(agent.status().code());
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<InitRecord> verdicts, group->all_gather_object(started));
  for (const InitRecord& r : verdicts) {
    if (!r.error.empty()) {
      if (agent.ok()) (*agent)->shutdown();
      return absl::Status(static_cast<absl::StatusCode>(r.code),
                          absl::StrCat("init_rpc failed on worker \"", r.info.name, "\": ", r.error));
    }
  }

  // Step 7: one round of calls so every pipe and channel is up, then a barrier so no
  // worker leaves before the slowest has finished.
  absl::Status pinged = (*agent)->ping_all(init_timeout);
  if (!pinged.ok()) {
    (*agent)->shutdown();
    return pinged;
  }
  absl::Status barrier = group->barrier();
  if (!barrier.ok()) {
    (*agent)->shutdown();
    return barrier;
  }
  return std::shared_ptr<RpcAgent>(*std::move(agent));
}

}  // namespace ferry
