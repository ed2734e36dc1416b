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
//   options.num_worker_threads = 8;
//   ferry::init_rpc("worker0", ferry::BackendType::PROCESS_GROUP, rank, world_size, options);
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "backends/agent_backend_options.h"
#include "backends/backend_registry.h"

namespace ferry {

// Thread-compatible. Its settings are AgentBackendOptions' (threads, heartbeat, job
// token, device maps); num_worker_threads is also the number of sender threads.
class ProcessGroupRpcBackendOptions final : public AgentBackendOptions {
 public:
  static constexpr int kDefaultNumWorkerThreads = 4;

  // (The pragmas keep the deprecated member's own initialization and copies quiet:
  // only a user's use of it warns.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  ProcessGroupRpcBackendOptions() : AgentBackendOptions(kDefaultNumWorkerThreads) {}
  ProcessGroupRpcBackendOptions(const ProcessGroupRpcBackendOptions&) = default;
  ProcessGroupRpcBackendOptions(ProcessGroupRpcBackendOptions&&) = default;
  ProcessGroupRpcBackendOptions& operator=(const ProcessGroupRpcBackendOptions&) = default;
  ProcessGroupRpcBackendOptions& operator=(ProcessGroupRpcBackendOptions&&) = default;
  ~ProcessGroupRpcBackendOptions() override = default;
#pragma GCC diagnostic pop

  std::string backend_name() const override { return BackendType::PROCESS_GROUP.name; }

  // Deprecated spelling of num_worker_threads (the seed's and PyTorch's), kept for one
  // release: set, it is used instead (setting both to different values is an error).
  [[deprecated("use num_worker_threads")]] std::optional<int> num_send_recv_threads;

 private:
  Alias<int> num_worker_threads_alias() const override;
};

// PROCESS_GROUP's options constructor. Keyword arguments: num_worker_threads (int64),
// heartbeat_ms (int64), auth_token (string; unset: FERRY_AUTH_TOKEN), device_maps
// (DeviceMaps), devices (vector<Device>); num_send_recv_threads (int64) is the
// deprecated spelling of num_worker_threads. Errors (kInvalidArgument): an unknown key
// (named, with the known ones), a value of the wrong type (naming the key and both
// types), a value validate() refuses.
absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_process_group_options(
    std::chrono::milliseconds rpc_timeout, const std::string& init_method, const Kwargs& kwargs);

// PROCESS_GROUP's init handler (static groups only: kUnimplemented without a world
// size, since a process group cannot grow).
absl::StatusOr<std::shared_ptr<RpcAgent>> init_process_group_backend(const BackendInitArgs& args);

}  // namespace ferry
