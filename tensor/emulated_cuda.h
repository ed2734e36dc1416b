// File: tensor/emulated_cuda.h
//
// EmulatedCudaRuntime: a CudaRuntime whose N "CUDA devices" are host memory and whose
// streams are honest. It lets the CUDA paths (device maps, staging, pools, streams and
// events) run, and fail, on a machine without a GPU:
// - each stream, the default stream of every device included, is a FIFO run by its
//   own thread; a copy happens when its stream reaches it (without a copy delay, a copy
//   of up to 64 KiB or a free queued on an idle stream runs at once on the calling
//   thread: the stream has reached it, and two thread hand-offs are saved; a larger
//   copy, or any operation with a delay, runs on the stream's thread);
// - an event completes when its stream passes the point it was recorded at, and
//   wait(stream, event) holds the stream back until then;
// - an optional copy-engine speed (EmulatedCudaOptions::copy_gbps, or
//   FERRY_EMULATE_CUDA_GBPS): a copy then takes at least its bytes over that rate;
// - an optional delay before every copy (EmulatedCudaOptions::copy_delay, or
//   FERRY_EMULATE_CUDA_DELAY_US) widens every race;
// - device memory comes from a stream-ordered pool per device: a block freed with
//   deallocate_async is reused only after its stream passes the free;
// - misuse is reported (EmulatedCudaOptions::abort_on_misuse: by aborting the process
//   with the reason on stderr, which fails any test): freeing memory that a queued
//   copy still uses, a copy into or out of freed memory or past the end of a block,
//   recording, waiting on or querying a destroyed event, using a destroyed stream, a
//   double free;
// - CUDA IPC across processes: a device's pool memory is a memfd that export_pool
//   hands out, an imported pointer is a mapping of it at the exported offset, and an
//   inter-process event is a pair of counters in shared memory (EmulatedCudaOptions::ipc).
//
//   auto previous = set_cuda_runtime(std::make_shared<EmulatedCudaRuntime>(2));
//   Tensor t = *Tensor::zeros({4}, DType::kFloat32, Device::cuda(1));
//
// With FERRY_EMULATE_CUDA=N in its environment, a process's default runtime is this
// one with N devices (tensor/cuda.h), so `ferry bench rpc --device cuda
// --emulate-cuda` and scripts/gpu-check.sh run here.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensor/cuda.h"

namespace ferry {

struct EmulatedCudaOptions {
  // Every copy waits this long on its stream before it runs.
  std::chrono::microseconds copy_delay{0};
  // When above 0, a copy of N bytes occupies its stream for at least N / copy_gbps
  // nanoseconds (the memcpy, then a sleep for the rest): a GPU's copy engine, whose time
  // grows with the bytes but costs the host no CPU. What staging overlaps with its
  // copies shows then, even on a host with few cores.
  double copy_gbps = 0;
  // Fill pool memory with 0xA5 bytes when it is handed out and when it returns, so that
  // a read that comes too early or too late sees garbage rather than plausible bytes.
  bool poison = false;
  // Misuse aborts the process (its reason on stderr); otherwise it is only recorded
  // (misuses()) and the call returns an error where it can, for tests of the emulator.
  bool abort_on_misuse = true;
  // Idle bytes a device's pool keeps; beyond them a returned block goes back to the
  // "driver" (the host allocator). The default keeps everything, as ferry's real pool
  // does (cudaMemPoolAttrReleaseThreshold).
  uint64_t release_threshold = UINT64_MAX;
  // CUDA IPC across processes (export_pool, import_pool, inter-process events): a
  // device's pool memory is a memfd of pool_capacity bytes (sparse: only what is
  // touched takes memory), which export_pool hands out and an importer maps; an
  // inter-process event is a pair of counters in a memfd. Without `ipc` every IPC call
  // fails, as on a runtime that cannot import (FERRY_EMULATE_CUDA_IPC=0).
  bool ipc = true;
  uint64_t pool_capacity = uint64_t{16} << 30;

  // The defaults, changed by FERRY_EMULATE_CUDA_DELAY_US (microseconds),
  // FERRY_EMULATE_CUDA_GBPS (copy_gbps), FERRY_EMULATE_CUDA_POISON=1 and FERRY_EMULATE_CUDA_IPC=0. A malformed value is an error naming the variable.
  static absl::StatusOr<EmulatedCudaOptions> from_environment();
};

// Thread-safe. Destruction drains every stream and joins its thread; memory still
// allocated is freed with it.
class EmulatedCudaRuntime final : public CudaRuntime {
 public:
  explicit EmulatedCudaRuntime(int device_count, EmulatedCudaOptions options = {});
  ~EmulatedCudaRuntime() override;
  EmulatedCudaRuntime(const EmulatedCudaRuntime&) = delete;
  EmulatedCudaRuntime& operator=(const EmulatedCudaRuntime&) = delete;

  int device_count() override;
  std::string unavailable_reason() override;
  absl::StatusOr<void*> allocate(int device, size_t bytes) override;
  void deallocate(int device, void* ptr) override;
  absl::StatusOr<void*> allocate_async(int device, size_t bytes, CudaStream stream) override;
  void deallocate_async(int device, void* ptr, CudaStream stream) override;
  CudaPoolStats pool_stats(int device) override;
  absl::StatusOr<void*> allocate_pinned(size_t bytes) override;
  void deallocate_pinned(void* ptr) override;
  absl::Status copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                          CudaStream stream) override;
  absl::StatusOr<CudaStream> create_stream(int device) override;
  void destroy_stream(CudaStream stream) override;
  absl::Status synchronize(CudaStream stream) override;
  absl::StatusOr<CudaEvent> create_event(int device) override;
  void destroy_event(CudaEvent event) override;
  absl::Status record(CudaEvent event, CudaStream stream) override;
  absl::Status wait(CudaStream stream, CudaEvent event) override;
  absl::Status synchronize(CudaEvent event) override;
  absl::StatusOr<bool> query(CudaEvent event) override;
  absl::StatusOr<int> export_pool(int device) override;
  absl::StatusOr<CudaImportedPool> import_pool(int fd) override;
  void release_imported_pool(CudaImportedPool pool) override;
  absl::StatusOr<CudaPointerExport> export_pointer(void* ptr) override;
  absl::StatusOr<void*> import_pointer(CudaImportedPool pool, const CudaPointerExport& data) override;
  absl::Status release_imported_pointer(void* ptr, CudaStream stream) override;
  absl::StatusOr<std::vector<CudaEvent>> create_ipc_events(int device, int count) override;
  absl::StatusOr<CudaIpcEvents> export_ipc_events(std::span<const CudaEvent> events) override;
  absl::StatusOr<std::vector<CudaEvent>> import_ipc_events(int device, int fd, std::string_view handles) override;

  // Every misuse reported so far, oldest first.
  std::vector<std::string> misuses() const;
  const EmulatedCudaOptions& options() const { return options_; }

  class Impl;

 private:
  const EmulatedCudaOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
