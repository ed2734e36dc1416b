// File: backends/tensorpipe/tensorpipe_backend.h
//
// The TENSORPIPE backend: its options type, its options constructor and its init
// handler, which runs the static-group steps of DESIGN.md ("TENSORPIPE init handler")
// over the store: an all-gather of every worker's device info and host, device-map
// validation, reverse maps and device list, the agent (listening), an all-gather of
// the agents' addresses that doubles as the barrier. No pipe opens during init: each
// opens on the first call between two workers.
//
// The agent's transport comes from the transport registry (agents/core/registry.h):
// the transports `transports` names (else FERRY_TRANSPORTS, else the defaults: the ring
// for peers on this host, TensorPipe's uv, and ibv where the hardware has it, across
// hosts), each peer reached through the first of them that reaches it.
//
//   TensorPipeRpcBackendOptions options;
//   options.num_worker_threads = 8;
//   FERRY_RETURN_IF_ERROR(options.set_device_map("worker1", {{0, 1}}));   // cuda:0 -> cuda:1
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "backends/agent_backend_options.h"
#include "backends/backend_registry.h"

namespace ferry {

// Thread-compatible. The settings every backend shares (threads, heartbeat, job token,
// device maps) are AgentBackendOptions'; validate() checks them and these, when the
// options are constructed and again at init.
class TensorPipeRpcBackendOptions final : public AgentBackendOptions {
 public:
  static constexpr int kDefaultNumWorkerThreads = 16;

  // (The pragmas keep the deprecated member's own initialization and copies quiet:
  // only a user's use of it warns.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  TensorPipeRpcBackendOptions() : AgentBackendOptions(kDefaultNumWorkerThreads) {}
  TensorPipeRpcBackendOptions(const TensorPipeRpcBackendOptions&) = default;
  TensorPipeRpcBackendOptions(TensorPipeRpcBackendOptions&&) = default;
  TensorPipeRpcBackendOptions& operator=(const TensorPipeRpcBackendOptions&) = default;
  TensorPipeRpcBackendOptions& operator=(TensorPipeRpcBackendOptions&&) = default;
  ~TensorPipeRpcBackendOptions() override = default;
#pragma GCC diagnostic pop

  std::string backend_name() const override { return BackendType::TENSORPIPE.name; }

  // The transports, by the names they registered under (registered_transports();
  // built in: ring, tcp, shm, ibv, uv); unset: FERRY_TRANSPORTS (comma-separated), else
  // the defaults (the ring for this host's peers, tcp for the others; not shm, uv or
  // ibv: the ring and tcp serve those peers). Every worker of a job must share a
  // transport: one listing only uv cannot be reached by one on the defaults.
  std::optional<std::vector<std::string>> transports;
  // TensorPipe's channels, a subset of {"xth", "cma", "mpt_uv", "basic"}; unset: the
  // viable ones but mpt_uv.
  std::optional<std::vector<std::string>> channels;

  // Deprecated spelling of `heartbeat`, kept for one release: set, it is used instead
  // (setting both to different values is an error).
  [[deprecated("use heartbeat")]] std::optional<std::chrono::milliseconds> heartbeat_interval;

  // AgentBackendOptions::validate(), then: kInvalidArgument for an empty transport
  // list, a transport name not registered (naming those that are), a name listed
  // twice, an unknown channel.
  absl::Status validate() const override;

 private:
  Alias<std::chrono::milliseconds> heartbeat_alias() const override;
};

// TENSORPIPE's options constructor. Keyword arguments: num_worker_threads (int64),
// heartbeat_ms (int64), auth_token (string; unset: the agent reads FERRY_AUTH_TOKEN),
// transports, channels (vector<string>), device_maps (DeviceMaps), devices
// (vector<Device>); heartbeat_interval_ms (int64) is the deprecated spelling of
// heartbeat_ms. Errors (kInvalidArgument): an unknown key (named, with the known ones),
// a value of the wrong type, settings that validate() refuses.
absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_tensorpipe_options(std::chrono::milliseconds rpc_timeout,
                                                                                const std::string& init_method,
                                                                                const Kwargs& kwargs);

// TENSORPIPE's init handler (static groups: world_size > 0). When any worker fails a
// step, every worker fails with the same error, naming the worker at fault.
absl::StatusOr<std::shared_ptr<RpcAgent>> init_tensorpipe_backend(const BackendInitArgs& args);

}  // namespace ferry
