// File: tools/bench/raw_tensorpipe.h
//
// The baseline of `ferry bench rpc`: a raw TensorPipe ping-pong between two processes,
// with the same transport and channels ferry is measured on, and nothing of ferry's
// on the path. The server echoes every message it reads (metadata and tensors) from
// its TensorPipe callbacks; the client measures the same things ferry's client does
// (see measure.h) into a SideResult. Receive buffers are allocated once and reused on
// both sides, which is the fair floor PEERS.md describes.
//
//   // in the server process
//   absl::Status s = run_raw_server(endpoint, dir + "/raw.addr", std::chrono::seconds(60));
//   // in the client process
//   absl::StatusOr<SideResult> r = run_raw_client(endpoint, dir + "/raw.addr", plan, std::chrono::seconds(60));
//
// The server publishes its listener's URL by writing `address_file` (atomically, via
// rename); the client waits for that file. The client ends the session with a quit
// message the server acknowledges, so neither side mistakes the end for a failure.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/bench/measure.h"

namespace ferry::tools::bench {

// A TensorPipe transport ("shm" or "uv") and the channels to register beside it
// ("cma", "basic").
struct RawEndpoint {
  std::string transport;
  std::vector<std::string> channels;
};

// Accepts one pipe and echoes every message on it until the client's quit message
// (OK) or an error, or until `timeout` passes (kDeadlineExceeded).
absl::Status run_raw_server(const RawEndpoint& endpoint, const std::string& address_file,
                            std::chrono::milliseconds timeout);

// Connects to the server whose URL appears in `address_file` and measures `plan`.
// Every wait is bounded by `timeout`.
absl::StatusOr<SideResult> run_raw_client(const RawEndpoint& endpoint, const std::string& address_file,
                                          const MeasurePlan& plan, std::chrono::milliseconds timeout);

}  // namespace ferry::tools::bench
