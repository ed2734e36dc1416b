// File: backends/agent_backend_options.h
//
// AgentBackendOptions: what the built-in backends' options (TensorPipeRpcBackendOptions,
// ProcessGroupRpcBackendOptions) share, with one spelling each: the agent's worker
// threads, heartbeat and job token, and the device maps (DeviceMapOptions, from
// device_maps/options.h). Each backend derives its options from it and adds its own
// (TENSORPIPE's transports and channels). A user-defined backend may derive from it
// too.
//
//   TensorPipeRpcBackendOptions options;                  // an AgentBackendOptions
//   options.num_worker_threads = 8;
//   options.heartbeat = std::chrono::seconds(2);
//   FERRY_RETURN_IF_ERROR(options.set_device_map("worker1", {{0, 1}}));
//   FERRY_RETURN_IF_ERROR(options.validate());
//   AgentOptions agent = options.agent_options();         // what the init handler starts
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "agents/core/options.h"
#include "backends/backend_registry.h"
#include "device_maps/options.h"

namespace ferry {

// Thread-compatible.
class AgentBackendOptions : public RpcBackendOptions, public DeviceMapOptions {
 public:
  static constexpr int kMaxWorkerThreads = 4096;
  static constexpr std::chrono::milliseconds kDefaultHeartbeat{std::chrono::seconds(5)};

  // Threads running incoming requests, continuations and listeners: [1, 4096]. (The
  // PROCESS_GROUP backend's senders are as many.)
  int num_worker_threads;
  // A peer with calls pending that sends nothing for this long is pinged, and declared
  // lost (its calls fail with kUnavailable, even those without a timeout) when the ping
  // goes unanswered as long again: a stopped or unreachable peer that never closed its
  // sockets. Zero turns it off. (AgentOptions::heartbeat.)
  std::chrono::milliseconds heartbeat = kDefaultHeartbeat;
  // The job token (docs/security.md): unset reads FERRY_AUTH_TOKEN; "" means none. See
  // AgentOptions::auth_token for what it guards.
  std::optional<std::string> auth_token;
  // The device channel every CUDA tensor must take ("cuda_ipc", or "staging" to keep
  // tensors in host memory): a call that would take another fails saying why. ""
  // reads FERRY_DEVICE_CHANNEL, and without it any channel goes. (AgentOptions::device_channel.)
  // set_device_channel(peer, channel) sets it per peer.
  std::string device_channel;
  // CUDA tensors of one message to a worker on this host that total fewer bytes than
  // this take staging rather than cuda_ipc, which costs more per message than a few KiB
  // of copies (CudaIpcOptions::min_bytes; docs/cuda.md). Unset reads
  // FERRY_CUDA_IPC_MIN_BYTES, else kCudaIpcMinBytes (64 KiB); 0 sends every message
  // over cuda_ipc where it can.
  std::optional<size_t> cuda_ipc_min_bytes;

  // kInvalidArgument, saying what was expected: num_worker_threads outside [1, 4096], a
  // negative rpc_timeout or heartbeat, a malformed FERRY_CUDA_IPC_MIN_BYTES (when
  // cuda_ipc_min_bytes is unset), a device_channel that names no channel ("cuda_ipc",
  // "staging" or ""), a deprecated spelling that disagrees with the current one. The
  // error names the spelling the user set.
  virtual absl::Status validate() const;

  // The agent's settings these options give: threads, rpc_timeout, heartbeat (a
  // deprecated spelling resolved), the job token (FERRY_AUTH_TOKEN when unset) and the
  // device maps. The init handler adds the rest (reverse maps, the devices the group
  // settled on, store prefix). Call validate() first.
  AgentOptions agent_options() const;

 protected:
  explicit AgentBackendOptions(int default_num_worker_threads)
      : num_worker_threads(default_num_worker_threads), default_num_worker_threads_(default_num_worker_threads) {}

  // A deprecated spelling of a setting, as a backend's options still accept it for a
  // release: its name (for errors) and its value when the user set it.
  template <typename T>
  struct Alias {
    const char* name = "";
    std::optional<T> value;
  };
  // The backend's deprecated spellings of num_worker_threads and heartbeat, if any.
  virtual Alias<int> num_worker_threads_alias() const { return {}; }
  virtual Alias<std::chrono::milliseconds> heartbeat_alias() const { return {}; }

 private:
  template <typename T>
  struct Resolved {
    const char* name;
    T value;
  };
  // A setting as the agent uses it; kInvalidArgument when both spellings were set and
  // disagree.
  absl::StatusOr<Resolved<int>> threads() const;
  absl::StatusOr<Resolved<std::chrono::milliseconds>> heartbeat_setting() const;

  int default_num_worker_threads_;
};

}  // namespace ferry
