// File: agents/core/options.h
//
// AgentOptions: every setting of the agent core (agents/core/agent.h), one spelling
// each. Every adapter's options embed it (RingAgentOptions::agent, ...), so that a
// setting is named, defaulted and checked in one place (Agent::start).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agents/core/device_channel.h"
#include "agents/rpc_agent.h"
#include "device_maps/device_map.h"

namespace ferry {

struct AgentOptions {
  // Threads running incoming requests, continuations and listeners; at least 1.
  int num_worker_threads = 16;
  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  // Where this worker's CUDA tensors land on each peer, and the maps replies travel
  // back on.
  DeviceMaps device_maps;
  DeviceMaps reverse_device_maps;
  // The CUDA devices this agent handles; empty: those its maps name (the local side of
  // device_maps and of reverse_device_maps).
  std::vector<Device> devices;
  // A peer with calls pending that sends nothing for this long is pinged; one that does
  // not answer the ping within it too is lost (its calls fail with kUnavailable, even
  // those with no timeout). Zero: off.
  std::chrono::milliseconds heartbeat{std::chrono::seconds(5)};
  // Store keys of this agent's join() rounds start with this.
  std::string store_prefix = "ferry/rpc/";
  // Requests served on the transport thread that received them (see InlineFilter);
  // unset: every request goes to the pool.
  InlineFilter serves_inline;
  // The job token (docs/security.md; "" for none; see base/auth.h's job_token() for the
  // FERRY_AUTH_TOKEN default). With one, every connection starts with a
  // challenge-response in which the opener proves the token and the worker name and id
  // it claims; a connection without the token, with another one, or claiming a name or
  // id the membership gives someone else is refused: its calls fail with
  // kUnauthenticated, and the refusing worker logs why. A second connection that
  // proves an id which already has one here replaces it (the older is closed: a
  // restarted worker). All workers of a group must agree.
  std::string auth_token;
  // With a token: how long a peer's connection may stay unauthenticated before it is
  // closed, and how long a connection this worker opens may wait for the peer's
  // challenge before the peer is lost (its calls fail with kUnavailable naming it).
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(5)};
  // Requests (kRequest) in flight between one caller and this worker: a caller writes
  // at most this many to a peer before replies come back, holding the rest (its
  // memory, not the server's); a server serving this many from one connection stops
  // reading it until one is answered (Connection::pause_reads), so a caller with a
  // larger setting, or one that is not ferry, waits in its own transport. Pings and
  // control requests are not counted, but wait unread behind a pause; the server then
  // sends kBusy every quarter heartbeat so that the caller's heartbeat still hears it.
  // A request a transport delivers past a pause is answered kResourceExhausted, unrun.
  // At least 1.
  int max_requests_in_flight = 1024;
  // What this worker lets pile up unsent on one connection before it stops taking that
  // connection's requests: this many bytes, or max_requests_in_flight messages
  // (Connection::unsent). A reply's room under max_requests_in_flight is freed when it
  // is written, so without this a caller that never reads its replies would grow the
  // worker by one per request. Past the bound the connection's reads pause (the flood
  // waits in the caller) until the backlog falls to half; one whose backlog does not
  // fall for two heartbeats (the rpc_timeout without heartbeats) is closed, the peer
  // named in the log. A connection whose reads cannot pause (it carries this worker's
  // calls too) is closed once it holds four times the messages. At least 1 MiB.
  size_t max_unsent_bytes = size_t{64} << 20;
  // Device channels tried before staging, in order (Agent::channel_for).
  std::vector<std::shared_ptr<DeviceChannel>> device_channels;
  // A device channel every device tensor must take ("cuda_ipc"; "" for none): a call
  // whose tensors to a peer would take another (staging, as a fallback) fails instead,
  // saying why that channel does not reach the peer. Unset: FERRY_DEVICE_CHANNEL.
  std::optional<std::string> device_channel;
  // The same per peer, by worker name, in place of device_channel towards that peer
  // ("" none required there); the device map's (DeviceMapOptions::set_device_channel).
  std::map<std::string, std::string> device_channel_by_peer;
  // The metrics endpoint's port (docs/observability.md; 0: any free one); unset:
  // FERRY_METRICS_PORT decides, and without it there is no endpoint.
  std::optional<int> metrics_port;
};

}  // namespace ferry
