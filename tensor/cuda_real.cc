// The runtime of a CUDA build, over the CUDA runtime API.
#include <cuda_runtime_api.h>

#include <mutex>

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

 private:
  std::once_flag probe_once_;
  int count_ = 0;
  std::string reason_;
};

}  // namespace

std::shared_ptr<CudaRuntime> make_default_cuda_runtime() { return std::make_shared<RealCudaRuntime>(); }

}  // namespace ferry
