// File: tools/devmaps_check.h
//
// The logic of `ferry devmaps check FILE.json`, kept free of I/O so that the
// subcommand (tools/devmaps_command.cc) only reads the file and prints. It checks a
// whole group's device configuration with the same device_maps/ functions the
// TENSORPIPE init handler runs, and reports what every worker's agent would get.
//
// Input (worker order is rank order; "static" defaults to true; "devices" and
// "device_maps" are optional):
//   {"static": true,
//    "workers": [{"name": "w0", "device_count": 2, "devices": ["cuda:0"],
//                 "device_maps": {"w1": {"cuda:0": "cuda:1"}}},
//                {"name": "w1", "device_count": 2}]}
//
// Where a worker runs, for the channel its device tensors take to each peer (all
// optional): "host" (workers without one share a host), "transports" (default
// ["ring", "tcp"]; cuda_ipc needs "ring" at both ends), "cuda_ipc" (false: its CUDA
// runtime cannot share pools, as with FERRY_EMULATE_CUDA_IPC=0), "device_channel"
// (the channel it requires: "cuda_ipc", "staging" or ""), "device_channels" (the same
// per peer, in place of "device_channel" towards the peers it names, as
// DeviceMapOptions::set_device_channel sets it: {"w1": "cuda_ipc"}), "cuda_ipc_min_bytes"
// (default kCudaIpcMinBytes). The report's "channels" gives, for every worker and
// every peer it sends device tensors to (its device maps' peers: requests; its
// reverse maps' peers: replies), the channel they take and why:
//   "channels": {"w0": {"w1": {"channel": "cuda_ipc", "why": "..."}}}
// with "channel" one of "cuda_ipc", "staging", or "none" where a required channel
// cannot be had (such calls fail, saying the same why).
//
//   DevmapsCheckResult r = check_devmaps_json(text);
//   // r.exit_code == kExitOk:     r.out = {"ok": true, "reverse_device_maps": {...}, "devices": {...}}
//   // r.exit_code == kExitFailed: r.out = {"ok": false, "error": "<validation message>"}
//   // r.exit_code == kExitUsage:  r.err says what is wrong with the input and where
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "device_maps/device_map.h"

namespace ferry::tools {

// A group's configuration as the input file gives it.
// kCudaIpcMinBytes (agents/cuda_ipc/cuda_ipc.h; the command asserts they agree), kept
// here so that the fuzzer builds this file with the device maps alone.
inline constexpr uint64_t kDefaultCudaIpcMinBytes = uint64_t{64} << 10;

// Where one worker runs, as far as its device channels care (see the file comment).
struct WorkerPlacement {
  std::string host;
  std::vector<std::string> transports = {"ring", "tcp"};
  bool cuda_ipc = true;
  std::string device_channel;
  std::map<std::string, std::string> device_channels;  // by peer name
  uint64_t cuda_ipc_min_bytes = kDefaultCudaIpcMinBytes;
};

struct DevmapsConfig {
  bool is_static_group = true;
  std::vector<WorkerDeviceInfo> workers;     // rank order
  std::vector<WorkerPlacement> placements;   // one per worker
};

// Parses the input file's text. Errors (kInvalidArgument) name the place, e.g.
//   workers[1].device_maps.w0: key "gpu:0": invalid device string "gpu:0": ...
// for malformed JSON, wrong types, missing "name" or "device_count", unknown keys,
// bad device strings, a source device given twice, and duplicate worker names.
absl::StatusOr<DevmapsConfig> parse_devmaps_config(std::string_view json_text);

struct DevmapsCheckResult {
  int exit_code = 0;  // kExitOk, kExitFailed or kExitUsage (tools/commands.h)
  std::string out;    // for stdout: one JSON object and a newline (exit 0 or 1)
  std::string err;    // for stderr: a line saying what is wrong with the input (exit 2)
};

// Parses, validates and reports; see the file comment.
DevmapsCheckResult check_devmaps_json(std::string_view json_text);

}  // namespace ferry::tools
