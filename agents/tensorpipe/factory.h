// File: agents/tensorpipe/factory.h
//
// TensorPipeAgent: makes the Agent (agents/core/agent.h) over TensorPipe, the transport
// adapter in this folder. Each
// worker listens on every enabled transport and publishes one address record; a pipe
// to a peer opens on the first call to it and then stays open (replies come back on
// it). Tensors in the tensor table travel as TensorPipe tensors through the best
// channel both sides have.
//
//   TensorPipeAgentOptions options;
//   options.num_worker_threads = 4;
//   absl::StatusOr<std::shared_ptr<Agent>> agent =
//       TensorPipeAgent::create(store, "worker0", /*rank=*/0, /*world_size=*/2, options, handler);
//
// Transports, highest priority first: ring (ferry's own shared-memory transport,
// agents/ring/factory.h: it serves every peer on this host and in this network
// namespace), shm (TensorPipe's, same host), ibv (when the hardware has it), uv (TCP).
// Channels, highest first: xth (same process), cma (same host, one
// copy), mpt (several TCP lanes; only when listed), basic (through the transport).
// `transports` / `channels` restrict these lists; with `transports` unset,
// FERRY_TRANSPORTS (a comma-separated list) does. The uv transport listens on the
// address base/net.h picks (FERRY_SOCKET_IFNAME, else the host name's address, else
// the interface that routes to the store's host).
// TensorPipe's shm transport runs one reactor thread per worker that polls while the
// worker lives: the defaults leave shm out when a host has more workers than cores
// (see shm_crowds_host(); docs/scale.md has the measurements).
//
// Threads: TensorPipe's loop threads only read, write and complete futures; requests,
// future callbacks and membership listeners run on a pool of num_worker_threads
// threads; one timer thread fails calls at their deadline.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "device_maps/device_map.h"
#include "store/store.h"

namespace ferry {

// The settings of a TensorPipe agent that a user chooses; TensorPipeRpcBackendOptions
// embeds them. validate() is the one place they are checked.
struct TensorPipeAgentSettings {
  static constexpr int kMaxWorkerThreads = 4096;
  // Threads running incoming requests, continuations and listeners.
  int num_worker_threads = 16;
  // Subsets of {"ring", "shm", "ibv", "uv"} and {"xth", "cma", "mpt_uv", "basic"};
  // unset: FERRY_TRANSPORTS, else the viable ones (ring when kRingByDefault, and then
  // not shm; see shm_crowds_host(); mpt_uv only when listed).
  std::optional<std::vector<std::string>> transports;
  std::optional<std::vector<std::string>> channels;
  // A peer with calls pending that sends nothing for this long is pinged, and declared
  // lost (its calls fail with kUnavailable, even those without a timeout) when the ping
  // goes unanswered as long again: a stopped or unreachable peer that never closed its
  // sockets. Zero turns it off.
  std::chrono::milliseconds heartbeat_interval{std::chrono::seconds(5)};
  // The job token (docs/security.md): unset reads FERRY_AUTH_TOKEN; "" means none.
  // See AgentOptions::auth_token for what it guards.
  std::optional<std::string> auth_token;

  // kInvalidArgument, saying what was expected: num_worker_threads outside [1, 4096],
  // a negative heartbeat_interval, an unknown or empty transport or channel list.
  absl::Status validate() const;
};

struct TensorPipeAgentOptions : TensorPipeAgentSettings {
  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  // create(): how long to wait for every worker's address.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(60)};
  // Where this worker's CUDA tensors land on each peer, the reverse maps replies travel
  // back on, and the devices this agent handles (from the init handler's steps 3-5).
  DeviceMaps device_maps;
  DeviceMaps reverse_device_maps;
  std::vector<Device> devices;
  // How many workers of the group run on this host (the init handler counts them);
  // with `transports` unset, shm is left out when shm_crowds_host(local_workers).
  int local_workers = 1;
  // Where this agent's keys go in the store (join() rounds; create()'s addresses). The
  // init handler scopes it per init, so a relaunch on the same store never reads an
  // earlier run's keys.
  std::string store_prefix = "ferry/rpc/";
  // Requests to serve on the transport thread (see InlineFilter); unset: none.
  InlineFilter serves_inline;
  // See AgentOptions::max_requests_in_flight.
  int max_requests_in_flight = 1024;
  // The store's host as the workers reach it (empty: unknown), for the listen-address
  // resolver: a host whose name resolves to loopback listens on the interface that
  // routes there (base/net.h).
  std::string store_host;
};

// Whether the default transports include the ring (and leave shm out): docs/performance.md
// ("ring") has the measurements that decided it.
inline constexpr bool kRingByDefault = true;

// Whether workers leave TensorPipe's shm transport out of their defaults: when the
// workers on this host (`local_workers`) outnumber its cores, since each shm worker
// keeps one polling thread busy for as long as it lives.
bool shm_crowds_host(int local_workers);

// The TensorPipe agent's makers and queries; it has no instances.
struct TensorPipeAgent {
  TensorPipeAgent() = delete;

  // A static group in one call: start(), publish the address in `store` (keys under
  // options.store_prefix), read everyone's, set_members(). No pipe opens until the
  // first call. Errors: bad options, duplicate worker names, kDeadlineExceeded when not
  // every worker published its address within init_timeout.
  static absl::StatusOr<std::shared_ptr<Agent>> create(std::shared_ptr<Store> store, std::string name, int rank,
                                                       int world_size, TensorPipeAgentOptions options,
                                                       RequestHandler handler);
  // Starts listening, with no members yet (init handlers that exchange addresses
  // themselves). `store` serves join(). Errors: bad options, no usable transport.
  static absl::StatusOr<std::shared_ptr<Agent>> start(std::shared_ptr<Store> store, std::string name, int rank,
                                                      TensorPipeAgentOptions options, RequestHandler handler);

  // For an agent start() made: the URL it listens on per transport ("uv" ->
  // "uv://127.0.0.1:41234"), and the transport and channel names it registered, in
  // priority order. Empty for an agent over another transport.
  static std::map<std::string, std::string> addresses(const Agent& agent);
  static std::vector<std::string> transports(const Agent& agent);
  static std::vector<std::string> channels(const Agent& agent);
};

}  // namespace ferry
