// File: agents/tensorpipe/factory.h
//
// TensorPipeAgent: makes the Agent (agents/core/agent.h) over TensorPipe, the transport
// adapter in this folder. Each worker listens on every enabled TensorPipe transport and
// publishes one address record; a pipe to a peer opens on the first call to it and
// then stays open (replies come back on it). Tensors in the tensor table travel as
// TensorPipe tensors through the best channel both sides have.
//
//   TensorPipeAgentOptions options;
//   options.agent.num_worker_threads = 4;
//   absl::StatusOr<std::shared_ptr<Agent>> agent =
//       TensorPipeAgent::create(store, "worker0", /*rank=*/0, /*world_size=*/2, options, handler);
//
// Transports, highest priority first: shm (same host), ibv (when the hardware has it),
// uv (TCP). Channels, highest first: xth (same process), cma (same host, one copy), mpt
// (several TCP lanes; only when listed), basic (through the transport). `transports` /
// `channels` restrict these lists. The uv transport listens on the address base/net.h
// picks (FERRY_SOCKET_IFNAME, else the host name's address, else the interface that
// routes to the store's host).
// TensorPipe's shm transport runs one reactor thread per worker that polls while the
// worker lives: the defaults leave shm out when a host has more workers than cores
// (see shm_crowds_host(); docs/scale.md has the measurements).
//
// The same transports register in the transport registry (agents/core/registry.h) as
// "shm", "ibv" and "uv", one entry sharing one TensorPipe context
// (tensorpipe_transport_entry(); one line in backends/builtin.cc): that is how init_rpc
// uses them, beside whatever else is registered (the ring).
//
// Threads: TensorPipe's loop threads only read, write and complete futures; requests,
// future callbacks and membership listeners run on a pool of
// AgentOptions::num_worker_threads threads; one timer thread fails calls at their
// deadline.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "agents/core/options.h"
#include "agents/core/registry.h"
#include "store/store.h"

namespace ferry {

// Thread-compatible.
struct TensorPipeAgentOptions {
  // The agent's settings, checked by Agent::start (AgentOptions::auth_token is used as
  // given: no environment default).
  AgentOptions agent;
  // Subsets of {"shm", "ibv", "uv"} and {"xth", "cma", "mpt_uv", "basic"}; unset: the
  // viable ones (not shm when shm_crowds_host(local_workers); mpt_uv only when listed).
  std::optional<std::vector<std::string>> transports;
  std::optional<std::vector<std::string>> channels;
  // How many workers of the group run on this host (see `transports`).
  int local_workers = 1;
  // The store's host as the workers reach it (empty: unknown), for the listen-address
  // resolver: a host whose name resolves to loopback listens on the interface that
  // routes there (base/net.h).
  std::string store_host;
  // create(): how long to wait for every worker's address.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(60)};

  // kInvalidArgument, saying what was expected: an unknown or empty transport or
  // channel list. (The agent's settings are Agent::start's to check.)
  absl::Status validate() const;
};

// Whether workers leave TensorPipe's shm transport out of their defaults: when the
// workers on this host (`local_workers`) outnumber its cores, since each shm worker
// keeps one polling thread busy for as long as it lives.
bool shm_crowds_host(int local_workers);

// TensorPipe's registry entry: "shm", "ibv", "uv" (one context for the names chosen),
// rank 200, a default; shm serves only this host's peers. It reaches a worker whose
// record has a line for one of them. Its maker takes args.channels, store_host,
// auth_token (for the open-listener warning) and local_workers; its check refuses an
// unknown channel.
TransportEntry tensorpipe_transport_entry();

// The TensorPipe agent's makers and queries; it has no instances.
struct TensorPipeAgent {
  TensorPipeAgent() = delete;

  // A static group in one call: start(), publish the address in `store` (keys under
  // options.agent.store_prefix), read everyone's, set_members(). No pipe opens until
  // the first call. Errors: bad options, duplicate worker names, kDeadlineExceeded
  // when not every worker published its address within init_timeout.
  static absl::StatusOr<std::shared_ptr<Agent>> create(std::shared_ptr<Store> store, std::string name, int rank,
                                                       int world_size, TensorPipeAgentOptions options,
                                                       RequestHandler handler);
  // Starts listening, with no members yet (init handlers that exchange addresses
  // themselves). `store` serves join(). Errors: bad options, no usable transport.
  static absl::StatusOr<std::shared_ptr<Agent>> start(std::shared_ptr<Store> store, std::string name, int rank,
                                                      TensorPipeAgentOptions options, RequestHandler handler);

  // For an agent over TensorPipe (alone, or as a part of its TransportSet): the URL it
  // listens on per transport ("uv" -> "uv://127.0.0.1:41234"), and the TensorPipe
  // transport and channel names it registered, in priority order. Empty for an agent
  // without TensorPipe.
  static std::map<std::string, std::string> addresses(const Agent& agent);
  static std::vector<std::string> transports(const Agent& agent);
  static std::vector<std::string> channels(const Agent& agent);
};

}  // namespace ferry
