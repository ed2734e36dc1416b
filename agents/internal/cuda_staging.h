// File: agents/internal/cuda_staging.h
//
// How CUDA tensors cross a CPU-only channel (Debian's TensorPipe has no CUDA channel):
// before sending, each CUDA tensor is copied to host memory and tagged with the device
// it must land on, found through the device map towards the peer (requests) or the
// reverse map towards the caller (replies); after receiving, each tagged buffer is
// copied to its device. This is the one place a real CUDA channel would replace.
//
//   std::vector<std::string> targets;
//   FERRY_RETURN_IF_ERROR(stage_outgoing(message.tensors(), targets, map, "worker1"));
//   ...send, receive...
//   FERRY_RETURN_IF_ERROR(land_incoming(received, targets));
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "device_maps/device_map.h"
#include "tensor/tensor.h"

namespace ferry::internal {

// Replaces every CUDA tensor in `tensors` by a host copy and sets targets[i] to the
// device tensor i must land on ("" for CPU tensors). `map` (may be null: no map) maps
// this worker's devices to `peer`'s. Errors (kInvalidArgument), before anything is
// sent: a CUDA tensor whose device has no entry in the map, naming the device and the
// peer; a failed copy. Runs the copies on the calling thread.
absl::Status stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets, const DeviceMap* map,
                            std::string_view peer);

// Moves every received buffer whose target is a device to that device. Errors: a
// target that does not parse or that this process does not have.
absl::Status land_incoming(std::vector<Tensor>& buffers, const std::vector<std::string>& targets);

}  // namespace ferry::internal
