// File: tools/bench/ring_floor.h
//
// The ring transport's own floor, for `ferry bench rpc --transports ring`: an 8-byte
// message bounced between two ring transports of one process, with no agent above
// them, each reply written by the data thread that received the message. What ferry
// adds on the ring is its figures minus this one.
#pragma once

#include <chrono>

#include "absl/status/statusor.h"
#include "tools/bench/measure.h"

namespace ferry::tools::bench {

// `iterations` round trips timed after `warmup` untimed ones.
absl::StatusOr<LatencyStats> ring_floor(int warmup, int iterations, std::chrono::milliseconds timeout);

}  // namespace ferry::tools::bench
