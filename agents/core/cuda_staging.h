// File: agents/core/cuda_staging.h
//
// CudaStaging: how CUDA tensors cross a CPU-only channel (Debian's TensorPipe has no
// CUDA channel), across hosts and as the fallback on one host.
//
// Outgoing, per device of a message: one event recorded on the device's default
// stream (the producer's) holds the device's staging stream back, the tensors are
// copied device-to-host on the staging stream into page-locked slots (tensors under
// kSharedSlotBytes share one slot; a larger one gets a slot of its own), one event
// recorded after the copies is waited for, and each tensor is replaced by its host
// bytes and tagged with the device it must land on (the device map towards the peer for
// requests, the reverse map towards the caller for replies). The device tensors stay
// referenced until that event: their memory returns to the pool on the default stream,
// which the staging stream does not order. The host waits once per device per message
// because the write may start only with the bytes in host memory; callers are user or
// pool threads, never a transport thread.
// Incoming, per device: the tensors are allocated from the device's pool on its
// default stream, the staging stream waits for that allocation (an event), copies the
// received bytes host-to-device, and records an event that the default stream waits
// on. The host does not wait: the tensors are ready on their device's default stream,
// so work queued on the default stream (what Tensor's own operations use) sees them,
// and a user's own stream orders itself after the default stream with an event. The
// received host buffers are held until the copies' event has passed (retired on later
// calls, or by the destructor).
//
// Large tensors (kChunkedBytes and up) cross in chunks, pipelined: the sending thread
// queues the device-to-host copies of a few chunks ahead into pinned slots and writes
// each chunk as a kChunk message (write_ahead) as soon as its event passes, while the
// copies of the next ones run; the tensor's place in the message is a 0-byte
// placeholder whose target, "staging|<transfer>|<dtype>|<shape>", names the transfer.
// The receiver copies each chunk host-to-device as it arrives (land_chunk, on the
// transport thread, without waiting), overlapping the receipt of the next, and swaps
// the placeholder for the landed tensor when the message arrives (claim_chunked). A
// connection delivers in order, so every chunk of a message has arrived by then.
//
// Devices: the agent handles exactly `devices`; streams exist for those only, and a
// tensor on any other device, either way, is an error naming the device and the list.
//
//   CudaStaging staging({Device::cuda(0)});
//   FERRY_RETURN_IF_ERROR(staging.stage_outgoing(tensors, targets, &map, "worker1"));
//   ...send, receive...
//   FERRY_RETURN_IF_ERROR(staging.land_incoming(received, targets));
#pragma once

#include <deque>
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
#include "tensor/cuda_streams.h"
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
                              std::string_view peer, WriteAhead write_ahead) override;

  // A kChunk message from worker `peer`: queues its host-to-device copy and returns
  // without waiting (a transport thread calls it). Errors, after which the connection
  // must be closed: a malformed chunk, one past its transfer's end, a device this
  // worker does not handle, more open transfers or bytes than a peer may have.
  absl::Status land_chunk(int peer, Wire wire) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether some target is a chunked tensor's placeholder.
  static bool names_chunked(const std::vector<std::string>& targets);
  // Replaces every placeholder in `wire` by its landed tensor, ready on the device's
  // default stream, and clears its target. Errors: a transfer that is unknown or not
  // complete (its chunks must precede the message on the connection).
  absl::Status claim_chunked(int peer, Wire& wire) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the transfers `peer` left unfinished (it was lost).
  void forget(int peer) override ABSL_LOCKS_EXCLUDED(mu_);

  // Moves every received buffer whose target is a device to that device. Errors: a
  // target that does not parse, or that is not among this worker's devices.
  absl::Status land_incoming(std::vector<Tensor>& buffers, const std::vector<std::string>& targets) override;
  std::map<std::string, std::string> debug_info() const override;
  // The same counters as Prometheus series, for the metrics endpoint:
  //   ferry_cuda_pool_allocations_total{device}, ferry_cuda_pool_bytes_total{device},
  //   ferry_cuda_pool_driver_allocations_total{device}, ferry_cuda_pool_driver_bytes_total{device},
  //   ferry_staging_pinned_total{outcome="hit"|"miss"},
  //   ferry_staging_tensors_total{direction="sent"|"landed"}, ferry_staging_chunks_total{direction}
  std::string prometheus() const;

  // Counters: pinned slots reused and allocated.
  uint64_t pinned_hits() const;
  uint64_t pinned_misses() const;

  // Tensors smaller than this, of one message and one device, share a pinned slot.
  static constexpr size_t kSharedSlotBytes = size_t{64} << 10;
  // Tensors this large and larger cross in chunks (see above).
  static constexpr size_t kChunkedBytes = size_t{2} << 20;
  // Chunks whose device-to-host copies are queued ahead of the one being written.
  static constexpr size_t kChunksAhead = 4;
  // A peer's unfinished transfers, at most.
  static constexpr size_t kMaxOpenTransfers = 64;
  // The chunk size for a tensor of `bytes` (FERRY_STAGING_CHUNK_KB overrides it).
  static size_t chunk_bytes(size_t bytes);

  class PinnedPool;

 private:
  // Host buffers of a landing, held until `copied` has passed.
  struct Retired {
    CudaEvent copied;
    std::vector<Tensor> held;
  };
  // A chunked tensor arriving: its device memory, and how many of its bytes came.
  struct Transfer {
    Tensor landed;  // flat uint8 on the device
    uint64_t received = 0;
  };
  using TransferKey = std::pair<int, uint64_t>;  // the sending worker's id, its transfer id

  absl::Status check_handled(Device device, std::string_view what) const ABSL_LOCKS_EXCLUDED(mu_);
  // The device's staging stream, and one stream waiting for another (tensor/cuda_streams.h).
  absl::StatusOr<CudaStream> stream_for(int device) { return streams_.get(device); }
  absl::Status order_after(CudaStream waiter, CudaStream signaller) {
    return ferry::order_after(*runtime_, waiter, signaller);
  }
  // Drops the held buffers of every landing whose copies have passed.
  void retire_passed() ABSL_LOCKS_EXCLUDED(mu_);
  // Holds `held` until what `stream` has queued so far has passed.
  absl::Status retire_after(CudaStream stream, std::vector<Tensor> held) ABSL_LOCKS_EXCLUDED(mu_);
  // Streams tensor `t` (on `device`, `stream` its staging stream) to the peer as kChunk
  // messages of transfer `id`, each written once its copy passed.
  absl::Status stream_chunks(const Tensor& t, int device, CudaStream stream, uint64_t id, const std::string& target,
                             WriteAhead write_ahead);
  // The first chunk of a transfer: its device memory, allocated in the default stream's
  // order, which the staging stream follows.
  absl::StatusOr<Transfer> open_transfer(int peer, Device device, uint64_t total) ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<CudaRuntime> runtime_;
  std::shared_ptr<PinnedPool> pinned_;
  CudaStreams streams_{runtime_};  // the staging stream per device
  mutable absl::Mutex mu_;
  std::vector<Device> devices_ ABSL_GUARDED_BY(mu_);
  std::deque<Retired> retired_ ABSL_GUARDED_BY(mu_);        // oldest first
  std::map<TransferKey, Transfer> transfers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_transfer_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t chunks_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t chunks_landed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t chunked_tensors_landed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t staged_tensors_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t shared_slots_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t landed_tensors_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry::internal
