// File: tools/bench/socket_floor.h
//
// The floor under `ferry bench rpc --transports tcp`: what a plain TCP socket does on
// this host, measured in the same run. A thread of the measuring process echoes what
// a connected loopback socket sends it (a size, then that many bytes, sent back
// whole): an 8-byte ping-pong and an echo of each size, each timed by the sender with
// blocking reads and writes and TCP_NODELAY. Nothing is allocated or copied beyond
// the socket's own copies. What ferry adds over tcp is its figures beside these.
#pragma once

#include <chrono>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/bench/measure.h"

namespace ferry::tools::bench {

struct SocketFloor {
  LatencyStats ping_pong;         // 8 bytes there and back
  std::vector<EchoResult> echo;   // per plan.echo_sizes
};

// Runs the ping-pong (plan.warmup + plan.iterations) and each echo of the plan.
absl::StatusOr<SocketFloor> socket_floor(const MeasurePlan& plan, std::chrono::milliseconds timeout);

}  // namespace ferry::tools::bench
