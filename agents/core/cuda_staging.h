// File: agents/core/cuda_staging.h
//
// CudaStaging: how CUDA tensors cross a CPU-only channel (Debian's TensorPipe has no
// CUDA channel). It is the one place a real CUDA channel would replace.
//
// Outgoing, each CUDA tensor is copied into a reused page-locked host buffer on its
// device's staging stream, ordered after the device's default stream (the producer's)
// by an event, and tagged with the device it must land on: the device map towards the
// peer for requests, the reverse map towards the caller for replies. The caller waits
// for the copies before the write starts; callers are user or pool threads, never a
// transport thread.
// Incoming, each tagged buffer is copied to its device on that device's staging
// stream; an event recorded after the copies makes the device's default stream (the
// consumer's) wait, and is waited for before the message is handed on, so its tensors
// are usable when the caller's future completes. The agent runs this on its pool.
//
// Devices: the agent handles exactly `devices`; streams exist for those only, and a
// tensor on any other device, either way, is an error naming the device and the list.
//
//   CudaStaging staging({Device::cuda(0)});
//   FERRY_RETURN_IF_ERROR(staging.stage_outgoing(tensors, targets, &map, "worker1"));
//   ...send, receive...
//   FERRY_RETURN_IF_ERROR(staging.land_incoming(received, targets));
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "agents/core/device_channel.h"
#include "device_maps/device_map.h"
#include "tensor/cuda.h"
#include "tensor/tensor.h"

namespace ferry::internal {

// Thread-safe.
class CudaStaging final : public DeviceChannel {
 public:
  // `devices`: the CUDA devices handled (CPU entries are ignored).
  explicit CudaStaging(std::vector<Device> devices);
  ~CudaStaging() override;
  CudaStaging(const CudaStaging&) = delete;
  CudaStaging& operator=(const CudaStaging&) = delete;

  // Dynamic groups: the device list changes as workers join.
  std::string_view name() const override { return "staging"; }
  bool reaches(const std::string&) const override { return true; }
  void set_devices(std::vector<Device> devices) override ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<Device> devices() const ABSL_LOCKS_EXCLUDED(mu_);

  // Replaces every CUDA tensor in `tensors` by a host copy and sets targets[i] to the
  // device tensor i must land on ("" for CPU tensors). `map` (may be null: no map) maps
  // this worker's devices to `peer`'s. Errors (kInvalidArgument), before anything is
  // sent: a CUDA tensor whose device has no entry in the map, or that is not among
  // this worker's devices, naming the device and the peer; a failed copy.
  absl::Status stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets, const DeviceMap* map,
                              std::string_view peer) override;

  // Moves every received buffer whose target is a device to that device. Errors: a
  // target that does not parse, or that is not among this worker's devices.
  absl::Status land_incoming(std::vector<Tensor>& buffers, const std::vector<std::string>& targets) override;
  std::map<std::string, std::string> debug_info() const override;

  // Counters: pinned buffers reused and allocated.
  uint64_t pinned_hits() const;
  uint64_t pinned_misses() const;

  class PinnedPool;

 private:
  absl::Status check_handled(Device device, std::string_view what) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<CudaStream> stream_for(int device) ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<CudaRuntime> runtime_;
  std::shared_ptr<PinnedPool> pinned_;
  mutable absl::Mutex mu_;
  std::vector<Device> devices_ ABSL_GUARDED_BY(mu_);
  std::map<int, CudaStream> streams_ ABSL_GUARDED_BY(mu_);  // by device index
};

}  // namespace ferry::internal
