// File: agents/tensorpipe_agent.h
//
// TensorPipeAgent: the RpcAgent over TensorPipe. Each worker listens on every enabled
// transport, publishes its name and addresses in the store, reads everyone else's,
// and opens one pipe to each worker (itself included) for the calls it makes; replies
// come back on the same pipe. Tensors in the tensor table travel as TensorPipe
// tensors through the best channel both sides have.
//
//   TensorPipeAgentOptions options;
//   options.num_worker_threads = 4;
//   absl::StatusOr<std::shared_ptr<TensorPipeAgent>> agent =
//       TensorPipeAgent::create(store, "worker0", /*rank=*/0, /*world_size=*/2, options, handler);
//
// Transports, highest priority first: shm (same host), ibv (when the hardware has
// it), uv (TCP). Channels, highest first: xth (same process), cma (same host, one
// copy), mpt (several TCP lanes; only when listed), basic (through the transport).
// `transports` / `channels` restrict these lists. The uv transport listens on the
// address of the interface named by FERRY_SOCKET_IFNAME, else the host name's address.
//
// Threads: TensorPipe's loop threads only read, write and complete futures; requests
// run on a pool of num_worker_threads threads; one timer thread fails calls whose
// deadline passed (checked every 10 ms, so a deadline fires up to 10 ms late).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/rpc_agent.h"
#include "device_maps/device_map.h"
#include "store/store.h"

namespace ferry {

struct TensorPipeAgentOptions {
  // Threads running incoming requests (user functions).
  int num_worker_threads = 16;
  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  // Timeout for the start-up exchange of addresses and for join() at shutdown.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(60)};
  // Subsets of {"shm", "ibv", "uv"} and {"xth", "cma", "mpt_uv", "basic"}; unset: all
  // that work here (mpt_uv only when listed).
  std::optional<std::vector<std::string>> transports;
  std::optional<std::vector<std::string>> channels;
  // Where this worker's CUDA tensors land on each peer, the reverse maps replies travel
  // back on, and the devices this agent handles (from the init handler's steps 3-5).
  DeviceMaps device_maps;
  DeviceMaps reverse_device_maps;
  std::vector<Device> devices;
};

// Thread-safe. Owned by shared_ptr; TensorPipe callbacks hold only weak references.
class TensorPipeAgent final : public RpcAgent {
 public:
  // Starts listening, exchanges addresses through `store` (keys under "ferry/rpc/"),
  // and connects to every worker. Errors: bad options (unknown transport or channel,
  // none usable), duplicate worker names, kDeadlineExceeded when not every worker
  // published its address within init_timeout.
  static absl::StatusOr<std::shared_ptr<TensorPipeAgent>> create(std::shared_ptr<Store> store, std::string name,
                                                                  int rank, int world_size,
                                                                  TensorPipeAgentOptions options,
                                                                  RequestHandler handler);
  ~TensorPipeAgent() override;

  Future<Message> send(int to, Message message,
                       std::optional<std::chrono::milliseconds> timeout = std::nullopt) override;
  const WorkerInfo& self() const override;
  absl::StatusOr<WorkerInfo> worker_info(std::string_view name) const override;
  absl::StatusOr<WorkerInfo> worker_info(int id) const override;
  std::vector<WorkerInfo> worker_infos() const override;
  std::chrono::milliseconds default_timeout() const override;
  absl::Status join(std::chrono::milliseconds timeout) override;
  absl::Status sync(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  std::map<std::string, std::string> debug_info() const override;

  // Sends a ping to every worker (itself too) and waits for all the replies, so every
  // pipe and channel is connected. Pings are answered by the agent, never by user code.
  absl::Status ping_all(std::chrono::milliseconds timeout);

  // The URL this agent listens on, per transport ("uv" -> "tcp://127.0.0.1:41234").
  std::map<std::string, std::string> addresses() const;

  // The transport and channel names this agent registered, in priority order.
  std::vector<std::string> transports() const;
  std::vector<std::string> channels() const;

  struct Impl;

 private:
  explicit TensorPipeAgent(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace ferry
