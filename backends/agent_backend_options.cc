#include "backends/agent_backend_options.h"

#include "absl/strings/str_cat.h"
#include "agents/cuda_ipc/cuda_ipc.h"
#include "agents/ring/factory.h"
#include "base/auth.h"
#include "base/status.h"

namespace ferry {
namespace {

// The setting from `current` (named `current_name`, `untouched` while it holds its
// default) or from `alias`, the deprecated spelling.
template <typename T, typename Resolved, typename Alias, typename Show>
absl::StatusOr<Resolved> resolve(const char* current_name, T current, bool untouched, const Alias& alias, Show show) {
  if (!alias.value) return Resolved{current_name, current};
  if (!untouched && current != *alias.value) {
    return absl::InvalidArgumentError(absl::StrCat(alias.name, " (deprecated) is ", show(*alias.value), " and ",
                                                   current_name, " is ", show(current),
                                                   "; set only ", current_name));
  }
  return Resolved{alias.name, *alias.value};
}

}  // namespace

absl::StatusOr<AgentBackendOptions::Resolved<int>> AgentBackendOptions::threads() const {
  return resolve<int, Resolved<int>>("num_worker_threads", num_worker_threads,
                                     num_worker_threads == default_num_worker_threads_, num_worker_threads_alias(),
                                     [](int n) { return absl::StrCat(n); });
}

absl::StatusOr<AgentBackendOptions::Resolved<std::chrono::milliseconds>> AgentBackendOptions::heartbeat_setting()
    const {
  return resolve<std::chrono::milliseconds, Resolved<std::chrono::milliseconds>>(
      "heartbeat", heartbeat, heartbeat == kDefaultHeartbeat, heartbeat_alias(),
      [](std::chrono::milliseconds ms) { return absl::StrCat(ms.count(), " ms"); });
}

absl::Status AgentBackendOptions::validate() const {
  FERRY_ASSIGN_OR_RETURN(Resolved<int> n, threads());
  if (n.value < 1 || n.value > kMaxWorkerThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.name, " must be in [1, ", kMaxWorkerThreads, "], got ", n.value));
  }
  if (rpc_timeout.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc_timeout must not be negative, got ", rpc_timeout.count(), " ms (zero means no timeout)"));
  }
  FERRY_ASSIGN_OR_RETURN(Resolved<std::chrono::milliseconds> h, heartbeat_setting());
  if (h.value.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(h.name, " must be >= 0 ms (0: off), got ", h.value.count(), " ms"));
  }
  if (!cuda_ipc_min_bytes.has_value()) FERRY_RETURN_IF_ERROR(CudaIpcOptions::from_environment().status());
  FERRY_RETURN_IF_ERROR(check_device_channel("device_channel", device_channel));
  for (const auto& [peer, channel] : device_channels()) {
    FERRY_RETURN_IF_ERROR(check_device_channel(absl::StrCat("the device channel to ", peer), channel));
  }
  return absl::OkStatus();
}

AgentOptions AgentBackendOptions::agent_options() const {
  AgentOptions agent;
  absl::StatusOr<Resolved<int>> n = threads();
  agent.num_worker_threads = n.ok() ? n->value : num_worker_threads;
  absl::StatusOr<Resolved<std::chrono::milliseconds>> h = heartbeat_setting();
  agent.heartbeat = h.ok() ? h->value : heartbeat;
  agent.rpc_timeout = rpc_timeout;
  agent.auth_token = internal::auth::job_token(auth_token);
  agent.device_maps = device_maps();
  // CUDA tensors to a worker on this host go device to device where both can share
  // their pools (agents/cuda_ipc/cuda_ipc.h); staging carries the rest.
  CudaIpcOptions ipc = CudaIpcOptions::from_environment().value_or(CudaIpcOptions());
  if (cuda_ipc_min_bytes.has_value()) ipc.min_bytes = *cuda_ipc_min_bytes;
  ipc.ring_reaches = ring_reaches;
  agent.device_channels.push_back(make_cuda_ipc_channel(ipc));
  if (!device_channel.empty()) agent.device_channel = device_channel;
  agent.device_channel_by_peer = device_channels();
  return agent;
}

}  // namespace ferry
