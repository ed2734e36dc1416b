// File: agents/tcp/options.h
//
// TcpOptions: the tcp transport's settings (agents/tcp/factory.h), and validate(),
// which checks them as given. Every field left unset takes its default from a
// FERRY_TCP_* variable when the transport is made, else the value its comment says.
//
//   TcpOptions options{.host = "127.0.0.1"};
//   FERRY_RETURN_IF_ERROR(validate(options));
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace ferry {

// Plain values; copied into the transport, which keeps no reference to them.
struct TcpOptions {
  // The numeric address to listen on. Unset (empty): the one the interface resolver
  // picks (base/net.h: FERRY_SOCKET_IFNAME, else the host name's address, else the
  // interface that reaches the store).
  std::string host;
  // The store's host, for the resolver (TransportArgs::store_host).
  std::string store_host;
  // The most bytes a connection queues for its peer (headers, metadata and the tensors
  // it holds) before it fails, naming the peer: a peer that stops reading costs this
  // much at most, and only its own connection. Unset (0): FERRY_TCP_SEND_QUEUE_MB,
  // else 4 GiB.
  size_t send_queue_bytes = 0;
  // TCP keepalive: an idle connection is probed after `keepalive`, then every
  // keepalive / 2, and ends after 4 unanswered probes. Unset (0): twice the agent's
  // heartbeat (TransportArgs::heartbeat), else FERRY_TCP_KEEPALIVE_MS, else 10 s.
  std::chrono::milliseconds keepalive{0};
  // Whether a connection a peer opened carries this worker's calls to that peer too
  // (Connection::carries_calls_to). Unset: FERRY_TCP_TWO_WAY (0 or 1), else yes.
  std::optional<bool> two_way = std::nullopt;
  // Whether a ferry thread that waits (a caller for its reply, an idle pool thread)
  // reads the sockets itself rather than wait for the loop thread to hand it what came
  // (base/progress.h). Unset: FERRY_TCP_DRIVEN (0 or 1), else yes.
  std::optional<bool> driven = std::nullopt;
};

// Checks `options` as given (before defaults): kInvalidArgument saying what was wrong.
absl::Status validate(const TcpOptions& options);

}  // namespace ferry
