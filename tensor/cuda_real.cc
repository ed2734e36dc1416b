// The runtime of a CUDA build, over the CUDA runtime API.
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

absl::Status cuda_error(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what, " failed: ", cudaGetErrorName(err), ": ",
                                          cudaGetErrorString(err)));
}

#define FERRY_CUDA_OK(call)                          \
  do {                                               \
    cudaError_t ferry_err_ = (call);                 \
    if (ferry_err_ != cudaSuccess) {                 \
      return cuda_error(#call, ferry_err_);          \
    }                                                \
  } while (0)

class RealCudaRuntime final : public CudaRuntime {
 public:
  int device_count() override {
    std::call_once(probe_once_, [this] {
      int count = 0;
      cudaError_t err = cudaGetDeviceCount(&count);
      if (err != cudaSuccess) {
        // No driver or no GPU: DESIGN.md counts any error here as zero devices.
        (void)cudaGetLastError();
        count_ = 0;
        reason_ = absl::StrCat("cudaGetDeviceCount failed: ", cudaGetErrorString(err));
      } else {
        count_ = count;
        if (count == 0) reason_ = "the CUDA runtime reports no devices";
      }
    });
    return count_;
  }
  std::string unavailable_reason() override {
    device_count();
    return reason_;
  }

  absl::StatusOr<void*> allocate(int device, size_t bytes) override {
    FERRY_CUDA_OK(cudaSetDevice(device));
    void* ptr = nullptr;
    FERRY_CUDA_OK(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes));
    return ptr;
  }
  void deallocate(int device, void* ptr) override {
    cudaSetDevice(device);
    cudaFree(ptr);
  }
  // Tensors' memory: cudaMallocFromPoolAsync on this device's pool, which keeps what it
  // has reserved across calls (its release threshold is the maximum), so that after a
  // warm-up no allocation reaches the driver. A growth of the pool's reserved memory
  // across an allocation is counted as one that did.
  absl::StatusOr<void*> allocate_async(int device, size_t bytes, CudaStream stream) override {
    Pool* pool = nullptr;
    if (absl::Status s = pool_for(device, &pool); !s.ok()) return s;
    absl::MutexLock lock(&pool->mu);
    FERRY_CUDA_OK(cudaSetDevice(device));
    uint64_t before = 0, after = 0;
    FERRY_CUDA_OK(cudaMemPoolGetAttribute(pool->pool, cudaMemPoolAttrReservedMemCurrent, &before));
    void* ptr = nullptr;
    FERRY_CUDA_OK(cudaMallocFromPoolAsync(&ptr, bytes == 0 ? 1 : bytes, pool->pool,
                                          static_cast<cudaStream_t>(stream.handle)));
    FERRY_CUDA_OK(cudaMemPoolGetAttribute(pool->pool, cudaMemPoolAttrReservedMemCurrent, &after));
    ++pool->stats.allocations;
    pool->stats.bytes += bytes;
    if (after > before) {
      ++pool->stats.driver_allocations;
      pool->stats.driver_bytes += after - before;
    }
    return ptr;
  }
  void deallocate_async(int device, void* ptr, CudaStream stream) override {
    cudaSetDevice(device);
    cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream.handle));
  }
  CudaPoolStats pool_stats(int device) override {
    if (device < 0 || device >= device_count()) return {};
    Pool& pool = pools_[static_cast<size_t>(device)];
    absl::MutexLock lock(&pool.mu);
    CudaPoolStats stats = pool.stats;
    uint64_t used = 0;
    if (cudaMemPoolGetAttribute(pool.pool, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess) {
      stats.used_bytes = used;
    } else {
      (void)cudaGetLastError();
    }
    return stats;
  }

  absl::StatusOr<void*> allocate_pinned(size_t bytes) override {
    void* ptr = nullptr;
    FERRY_CUDA_OK(cudaMallocHost(&ptr, bytes == 0 ? 1 : bytes));
    return ptr;
  }
  void deallocate_pinned(void* ptr) override { cudaFreeHost(ptr); }

  absl::Status copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                          CudaStream stream) override {
    if (bytes == 0) return absl::OkStatus();
    FERRY_CUDA_OK(cudaSetDevice(stream.device));
    cudaMemcpyKind kind = cudaMemcpyDefault;
    if (dst_device.is_cuda() && src_device.is_cuda() && dst_device != src_device) {
      FERRY_CUDA_OK(cudaMemcpyPeerAsync(dst, dst_device.index(), src, src_device.index(), bytes,
                                        static_cast<cudaStream_t>(stream.handle)));
      return absl::OkStatus();
    }
    FERRY_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream.handle)));
    return absl::OkStatus();
  }

  absl::StatusOr<CudaStream> create_stream(int device) override {
    FERRY_CUDA_OK(cudaSetDevice(device));
    cudaStream_t stream = nullptr;
    FERRY_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return CudaStream{device, stream};
  }
  void destroy_stream(CudaStream stream) override {
    if (stream.handle != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream.handle));
  }
  absl::Status synchronize(CudaStream stream) override {
    FERRY_CUDA_OK(cudaSetDevice(stream.device));
    FERRY_CUDA_OK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
    return absl::OkStatus();
  }

  absl::StatusOr<CudaEvent> create_event(int device) override {
    FERRY_CUDA_OK(cudaSetDevice(device));
    cudaEvent_t event = nullptr;
    FERRY_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return CudaEvent{device, event};
  }
  void destroy_event(CudaEvent event) override {
    if (event.handle != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event.handle));
  }
  absl::Status record(CudaEvent event, CudaStream stream) override {
    FERRY_CUDA_OK(cudaSetDevice(stream.device));
    FERRY_CUDA_OK(cudaEventRecord(static_cast<cudaEvent_t>(event.handle), static_cast<cudaStream_t>(stream.handle)));
    return absl::OkStatus();
  }
  absl::Status wait(CudaStream stream, CudaEvent event) override {
    FERRY_CUDA_OK(cudaSetDevice(stream.device));
    FERRY_CUDA_OK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.handle),
                                      static_cast<cudaEvent_t>(event.handle), 0));
    return absl::OkStatus();
  }
  absl::Status synchronize(CudaEvent event) override {
    FERRY_CUDA_OK(cudaEventSynchronize(static_cast<cudaEvent_t>(event.handle)));
    return absl::OkStatus();
  }
  absl::StatusOr<bool> query(CudaEvent event) override {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event.handle));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    return cuda_error("cudaEventQuery", err);
  }

  // ---- CUDA IPC: pools exported as POSIX descriptors, legacy IPC event handles ----
  absl::StatusOr<int> export_pool(int device) override {
    Pool* pool = nullptr;
    if (absl::Status s = pool_for(device, &pool); !s.ok()) return s;
    if (!pool->exportable) {
      return absl::UnimplementedError(absl::StrCat("export_pool(cuda:", device,
                                                   "): the device's pool cannot be exported as a POSIX descriptor"));
    }
    int fd = -1;
    FERRY_CUDA_OK(cudaMemPoolExportToShareableHandle(&fd, pool->pool, cudaMemHandleTypePosixFileDescriptor, 0));
    absl::MutexLock lock(&pool->mu);
    ++pool->stats.exports;
    return fd;
  }
  absl::StatusOr<CudaImportedPool> import_pool(int fd) override {
    cudaMemPool_t pool = nullptr;
    FERRY_CUDA_OK(cudaMemPoolImportFromShareableHandle(&pool, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                       cudaMemHandleTypePosixFileDescriptor, 0));
    // Every device of this process may read and write it (peer access where needed).
    for (int d = 0; d < device_count(); ++d) {
      cudaMemAccessDesc access = {};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = d;
      access.flags = cudaMemAccessFlagsProtReadWrite;
      if (cudaMemPoolSetAccess(pool, &access, 1) != cudaSuccess) (void)cudaGetLastError();
    }
    return CudaImportedPool{pool};
  }
  void release_imported_pool(CudaImportedPool pool) override {
    cudaMemPoolDestroy(static_cast<cudaMemPool_t>(pool.handle));
  }
  absl::StatusOr<CudaPointerExport> export_pointer(void* ptr) override {
    static_assert(sizeof(cudaMemPoolPtrExportData) <= sizeof(CudaPointerExport::data));
    cudaMemPoolPtrExportData data = {};
    FERRY_CUDA_OK(cudaMemPoolExportPointer(&data, ptr));
    CudaPointerExport out;
    std::memcpy(out.data, &data, sizeof(data));
    return out;
  }
  absl::StatusOr<void*> import_pointer(CudaImportedPool pool, const CudaPointerExport& x) override {
    cudaMemPoolPtrExportData data = {};
    std::memcpy(&data, x.data, sizeof(data));
    void* ptr = nullptr;
    FERRY_CUDA_OK(cudaMemPoolImportPointer(&ptr, static_cast<cudaMemPool_t>(pool.handle), &data));
    return ptr;
  }
  absl::Status release_imported_pointer(void* ptr, CudaStream stream) override {
    FERRY_CUDA_OK(cudaSetDevice(stream.device));
    FERRY_CUDA_OK(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream.handle)));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<CudaEvent>> create_ipc_events(int device, int count) override {
    FERRY_CUDA_OK(cudaSetDevice(device));
    std::vector<CudaEvent> out;
    for (int i = 0; i < count; ++i) {
      cudaEvent_t event = nullptr;
      cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming);
      if (err != cudaSuccess) {
        for (CudaEvent& e : out) cudaEventDestroy(static_cast<cudaEvent_t>(e.handle));
        return cuda_error("cudaEventCreateWithFlags(cudaEventInterprocess)", err);
      }
      out.push_back(CudaEvent{device, event});
    }
    return out;
  }
  // No descriptor: the handles are cudaIpcEventHandle_t bytes, one after another.
  absl::StatusOr<CudaIpcEvents> export_ipc_events(std::span<const CudaEvent> events) override {
    CudaIpcEvents out;
    for (const CudaEvent& e : events) {
      cudaIpcEventHandle_t handle;
      FERRY_CUDA_OK(cudaIpcGetEventHandle(&handle, static_cast<cudaEvent_t>(e.handle)));
      out.handles.append(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }
    return out;
  }
  absl::StatusOr<std::vector<CudaEvent>> import_ipc_events(int device, int, std::string_view handles) override {
    if (handles.empty() || handles.size() % sizeof(cudaIpcEventHandle_t) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("import_ipc_events: ", handles.size(),
                                                     " bytes of handles (expected a multiple of ",
                                                     sizeof(cudaIpcEventHandle_t), ")"));
    }
    FERRY_CUDA_OK(cudaSetDevice(device));
    std::vector<CudaEvent> out;
    for (size_t at = 0; at < handles.size(); at += sizeof(cudaIpcEventHandle_t)) {
      cudaIpcEventHandle_t handle;
      std::memcpy(&handle, handles.data() + at, sizeof(handle));
      cudaEvent_t event = nullptr;
      cudaError_t err = cudaIpcOpenEventHandle(&event, handle);
      if (err != cudaSuccess) {
        for (CudaEvent& e : out) cudaEventDestroy(static_cast<cudaEvent_t>(e.handle));
        return cuda_error("cudaIpcOpenEventHandle", err);
      }
      out.push_back(CudaEvent{device, event});
    }
    return out;
  }

 private:
  struct Pool {
    absl::Mutex mu;
    cudaMemPool_t pool = nullptr;  // set once, under pools_once_
    bool exportable = false;       // made with a POSIX descriptor handle type
    CudaPoolStats stats ABSL_GUARDED_BY(mu);
  };

  // This device's pool, created on first use for every device at once.
  absl::Status pool_for(int device, Pool** out) {
    int count = device_count();
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda:", device, " out of range (this process has ", count, " CUDA devices)"));
    }
    std::call_once(pools_once_, [this, count] {
      pools_ = std::make_unique<Pool[]>(static_cast<size_t>(count));
      for (int d = 0; d < count; ++d) {
        Pool& p = pools_[static_cast<size_t>(d)];
        pools_status_ = make_pool(d, &p.pool, &p.exportable);
        if (!pools_status_.ok()) return;
      }
    });
    if (!pools_status_.ok()) return pools_status_;
    *out = &pools_[static_cast<size_t>(device)];
    return absl::OkStatus();
  }

  // A pool that can be exported as a POSIX descriptor (CUDA IPC on one host) where the
  // driver allows it, else a plain one.
  static absl::Status make_pool(int device, cudaMemPool_t* pool, bool* exportable) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    props.handleTypes = cudaMemHandleTypePosixFileDescriptor;
    FERRY_CUDA_OK(cudaSetDevice(device));
    *exportable = cudaMemPoolCreate(pool, &props) == cudaSuccess;
    if (!*exportable) {
      (void)cudaGetLastError();
      props.handleTypes = cudaMemHandleTypeNone;
      FERRY_CUDA_OK(cudaMemPoolCreate(pool, &props));
    }
    uint64_t keep_everything = UINT64_MAX;
    FERRY_CUDA_OK(cudaMemPoolSetAttribute(*pool, cudaMemPoolAttrReleaseThreshold, &keep_everything));
    return absl::OkStatus();
  }

  std::once_flag pools_once_;
  std::unique_ptr<Pool[]> pools_;  // by device, written once under pools_once_
  absl::Status pools_status_;
  std::once_flag probe_once_;
  int count_ = 0;
  std::string reason_;
};

}  // namespace

namespace internal {
std::shared_ptr<CudaRuntime> make_builtin_cuda_runtime() { return std::make_shared<RealCudaRuntime>(); }
}  // namespace internal

}  // namespace ferry
