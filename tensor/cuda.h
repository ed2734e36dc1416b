// File: tensor/cuda.h
//
// CudaRuntime: the one small interface through which ferry touches CUDA memory,
// copies, streams and events. Everything above tensor/ goes through it, so the
// staging path of DESIGN.md ("Moving CUDA tensors") can run on a real GPU, or without
// one on EmulatedCudaRuntime (tensor/emulated_cuda.h), whose "CUDA devices" are host
// memory and whose streams really run asynchronously, each on its own thread.
//
//   std::shared_ptr<CudaRuntime> cuda = cuda_runtime();
//   if (cuda->device_count() == 0) std::cerr << cuda->unavailable_reason();
//
// Which runtime is installed: with FERRY_EMULATE_CUDA=N in the environment, the
// emulator with N devices (for running `ferry bench rpc --device cuda`, the examples
// and scripts/gpu-check.sh on a machine without a GPU); otherwise a build with CUDA
// uses the CUDA runtime API, where any error from cudaGetDeviceCount (no driver, say)
// counts as zero devices, and a build without CUDA has zero devices.
// set_cuda_runtime() replaces any of them.
//
// Device memory of tensors comes from a stream-ordered pool per device
// (allocate_async/deallocate_async: cudaMallocAsync on a cudaMemPool_t that keeps its
// memory across calls), never a cudaMalloc/cudaFree per tensor. A tensor's memory is
// allocated and returned on its device's default stream, so whoever uses it on another
// stream orders that stream against the default stream with events.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/device.h"

namespace ferry {

// A CUDA stream on one device. A null handle is that device's default stream.
struct CudaStream {
  int device = 0;
  void* handle = nullptr;
};

// A CUDA event on one device.
struct CudaEvent {
  int device = 0;
  void* handle = nullptr;
};

// Counters of one device's stream-ordered pool (CudaRuntime::pool_stats).
struct CudaPoolStats {
  uint64_t allocations = 0;         // served by the pool, in all
  uint64_t bytes = 0;               // bytes of those allocations
  uint64_t driver_allocations = 0;  // of those, how many made the pool grow (reached the driver)
  uint64_t driver_bytes = 0;        // bytes the pool obtained from the driver, in all
  uint64_t used_bytes = 0;          // allocated now and not yet returned to the pool
  uint64_t exports = 0;             // export_pool calls that handed out a descriptor
};

// What another process needs to open one allocation of an exported pool
// (cudaMemPoolPtrExportData: 64 opaque bytes, plain data to send as it is).
struct CudaPointerExport {
  unsigned char data[64] = {};
};

// A pool another process exported, imported into this one (a cudaMemPool_t).
struct CudaImportedPool {
  void* handle = nullptr;
};

// Inter-process events as another process opens them: a descriptor (-1 when the
// runtime needs none; else owned by whoever holds this) and opaque handle bytes.
struct CudaIpcEvents {
  int fd = -1;
  std::string handles;
};

// Thread-safe: every method may be called from any thread. Copies are asynchronous
// with respect to the host only where the implementation says so; a caller orders
// work with streams and events, and waits with synchronize().
class CudaRuntime {
 public:
  virtual ~CudaRuntime() = default;

  // Number of usable devices; 0 when there is no GPU, no driver or no CUDA build.
  virtual int device_count() = 0;
  // Why device_count() is 0, in words fit for an error or a test skip; empty otherwise.
  virtual std::string unavailable_reason() = 0;

  // Device memory straight from the driver (cudaMalloc); the caller owns it and frees it
  // with deallocate on the same device. Tensors do not use it: see allocate_async.
  virtual absl::StatusOr<void*> allocate(int device, size_t bytes) = 0;
  virtual void deallocate(int device, void* ptr) = 0;
  // Device memory from `device`'s pool, usable by work queued on `stream` after this
  // call (cudaMallocAsync). deallocate_async returns it to the pool once `stream`
  // passes the point of the call: work on other streams that uses it must be ordered
  // before that point with events, or it races with the memory's next owner.
  virtual absl::StatusOr<void*> allocate_async(int device, size_t bytes, CudaStream stream) = 0;
  virtual void deallocate_async(int device, void* ptr, CudaStream stream) = 0;
  // The pool's counters for `device` (zeros for a device out of range).
  virtual CudaPoolStats pool_stats(int device) = 0;
  // Page-locked host memory for staging; freed with deallocate_pinned.
  virtual absl::StatusOr<void*> allocate_pinned(size_t bytes) = 0;
  virtual void deallocate_pinned(void* ptr) = 0;

  // Copies `bytes` from src (on src_device) to dst (on dst_device), enqueued on `stream`.
  // The caller keeps both buffers alive until the stream has passed the copy.
  virtual absl::Status copy_async(void* dst, Device dst_device, const void* src, Device src_device,
                                  size_t bytes, CudaStream stream) = 0;

  virtual absl::StatusOr<CudaStream> create_stream(int device) = 0;
  virtual void destroy_stream(CudaStream stream) = 0;
  // Blocks the calling thread until all work on `stream` is done.
  virtual absl::Status synchronize(CudaStream stream) = 0;

  virtual absl::StatusOr<CudaEvent> create_event(int device) = 0;
  virtual void destroy_event(CudaEvent event) = 0;
  // Marks the point in `stream` that `event` completes at.
  virtual absl::Status record(CudaEvent event, CudaStream stream) = 0;
  // Makes later work on `stream` wait for `event`, without blocking the host.
  virtual absl::Status wait(CudaStream stream, CudaEvent event) = 0;
  // Blocks the calling thread until `event` has completed.
  virtual absl::Status synchronize(CudaEvent event) = 0;
  // Whether `event` has completed, without blocking (an event never recorded has).
  virtual absl::StatusOr<bool> query(CudaEvent event) = 0;

  // ---- Inter-process memory and events (CUDA IPC), for workers on one host ----
  // A runtime without them returns kUnimplemented saying why. The exporting process
  // keeps an exported allocation alive until every importer has released it (and the
  // importer's release has passed on its stream).
  //
  //   exporter: int fd = *cuda->export_pool(0);               // once per peer; send fd
  //             CudaPointerExport x = *cuda->export_pointer(p); // per tensor; send x
  //   importer: CudaImportedPool pool = *cuda->import_pool(fd);   // once
  //             void* q = *cuda->import_pointer(pool, x);         // q is p's memory
  //
  // `device`'s pool as a POSIX file descriptor (cudaMemPoolExportToShareableHandle),
  // owned by the caller, who passes it on (SCM_RIGHTS) and closes it.
  virtual absl::StatusOr<int> export_pool(int device);
  // Opens a pool a peer exported (cudaMemPoolImportFromShareableHandle). `fd` stays
  // the caller's. Errors: a descriptor that is not an exported pool of this kind of
  // runtime, or a runtime that cannot import.
  virtual absl::StatusOr<CudaImportedPool> import_pool(int fd);
  // Closes an imported pool; its imported pointers must have been released.
  virtual void release_imported_pool(CudaImportedPool pool);
  // The data that names `ptr`, a live allocation of one of this process's pools
  // (cudaMemPoolExportPointer).
  virtual absl::StatusOr<CudaPointerExport> export_pointer(void* ptr);
  // This process's address of the allocation `data` names in `pool`
  // (cudaMemPoolImportPointer). Errors: data of another pool, or out of its range.
  virtual absl::StatusOr<void*> import_pointer(CudaImportedPool pool, const CudaPointerExport& data);
  // Releases an imported pointer once `stream` passes this point (cudaFreeAsync): the
  // exporter may free the allocation only after that.
  virtual absl::Status release_imported_pointer(void* ptr, CudaStream stream);
  // `count` inter-process events on `device` (cudaEventInterprocess): recorded,
  // waited on, queried and destroyed like any event, in this process or another.
  virtual absl::StatusOr<std::vector<CudaEvent>> create_ipc_events(int device, int count);
  // What another process needs to open `events`, all made by one create_ipc_events
  // call here (cudaIpcGetEventHandle each).
  virtual absl::StatusOr<CudaIpcEvents> export_ipc_events(std::span<const CudaEvent> events);
  // Opens events another process exported (cudaIpcOpenEventHandle each), on `device`.
  // `fd` stays the caller's. A wait on an opened event holds the stream back until the
  // exporter's stream passes the record it made last before the wait was queued.
  virtual absl::StatusOr<std::vector<CudaEvent>> import_ipc_events(int device, int fd, std::string_view handles);
};

// The stream a user's work on `device` runs on, for the calling thread: the stream of
// the innermost CudaStreamScope on that device, else the device's default stream.
// ferry's sends order their copies after it, so a tensor produced there may be passed
// at once.
CudaStream current_cuda_stream(int device);

// Names `stream` as the calling thread's stream on its device until the scope ends
// (scopes nest; each restores what it replaced). The runtime is not involved: the
// caller keeps the stream alive while the scope lives.
//
//   CudaStreamScope on(my_stream);                       // my_stream produced x
//   Tensor y = rpc_sync<Tensor>("worker1", "forward", x);  // copies x after my_stream's work
class CudaStreamScope {
 public:
  explicit CudaStreamScope(CudaStream stream);
  ~CudaStreamScope();
  CudaStreamScope(const CudaStreamScope&) = delete;
  CudaStreamScope& operator=(const CudaStreamScope&) = delete;

 private:
  friend CudaStream current_cuda_stream(int device);
  const CudaStreamScope* const outer_;
  const CudaStream stream_;
};

// Makes `stream` wait, without blocking the host, for what `device`'s default stream has
// queued so far: after a call returns CUDA tensors (ready on their device's default
// stream), work queued on `stream` then sees them.
absl::Status wait_for_default_stream(CudaStream stream);

// The process's runtime. Thread-safe. Tensors keep the runtime that allocated them
// alive, so replacing it never strands memory.
std::shared_ptr<CudaRuntime> cuda_runtime();

// Installs `runtime` as the process's runtime and returns the previous one. Meant for
// tests (EmulatedCudaRuntime) and for embedding a custom allocator; call it before
// creating CUDA tensors that should use it.
std::shared_ptr<CudaRuntime> set_cuda_runtime(std::shared_ptr<CudaRuntime> runtime);

// The runtime built into this binary (real CUDA, or the no-device runtime), or the
// emulator when FERRY_EMULATE_CUDA names a device count (tensor/emulated_cuda.h).
std::shared_ptr<CudaRuntime> make_default_cuda_runtime();

// OK when `device` is the CPU or a CUDA device the process's runtime has; otherwise an
// error saying which device was asked for and how many there are (and why none).
absl::Status check_device_available(Device device);

// Why this host has no usable CUDA device, or "" when it has one, asked in a forked
// child process: CUDA does not survive fork(), so a program that forks its workers
// (the examples, `ferry bench`) must not initialize CUDA before it forks. Call it from
// a process with no other threads running.
std::string cuda_missing_in_child();

}  // namespace ferry
