#include "tensor/host_backed_cuda.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry {

std::string HostBackedCudaRuntime::unavailable_reason() {
  return device_count_ == 0 ? "host-backed CUDA runtime configured with 0 devices" : "";
}

absl::Status HostBackedCudaRuntime::check(int device) const {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda:", device, " out of range (host-backed runtime has ", device_count_, " devices)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> HostBackedCudaRuntime::allocate(int device, size_t bytes) {
  if (absl::Status s = check(device); !s.ok()) return s;
  void* ptr = std::malloc(bytes == 0 ? 1 : bytes);
  if (ptr == nullptr) return absl::ResourceExhaustedError(absl::StrCat("out of memory allocating ", bytes, " bytes"));
  return ptr;
}

void HostBackedCudaRuntime::deallocate(int, void* ptr) { std::free(ptr); }

absl::StatusOr<void*> HostBackedCudaRuntime::allocate_pinned(size_t bytes) { return allocate(0, bytes); }

void HostBackedCudaRuntime::deallocate_pinned(void* ptr) { std::free(ptr); }

absl::Status HostBackedCudaRuntime::copy_async(void* dst, Device dst_device, const void* src, Device src_device,
                                               size_t bytes, CudaStream stream) {
  if (dst_device.is_cuda()) {
    if (absl::Status s = check(dst_device.index()); !s.ok()) return s;
  }
  if (src_device.is_cuda()) {
    if (absl::Status s = check(src_device.index()); !s.ok()) return s;
  }
  if (absl::Status s = check(stream.device); !s.ok()) return s;
  if (bytes > 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<CudaStream> HostBackedCudaRuntime::create_stream(int device) {
  if (absl::Status s = check(device); !s.ok()) return s;
  return CudaStream{device, nullptr};
}
void HostBackedCudaRuntime::destroy_stream(CudaStream) {}
absl::Status HostBackedCudaRuntime::synchronize(CudaStream stream) { return check(stream.device); }
absl::StatusOr<CudaEvent> HostBackedCudaRuntime::create_event(int device) {
  if (absl::Status s = check(device); !s.ok()) return s;
  return CudaEvent{device, nullptr};
}
void HostBackedCudaRuntime::destroy_event(CudaEvent) {}
absl::Status HostBackedCudaRuntime::record(CudaEvent event, CudaStream) { return check(event.device); }
absl::Status HostBackedCudaRuntime::wait(CudaStream stream, CudaEvent) { return check(stream.device); }
absl::Status HostBackedCudaRuntime::synchronize(CudaEvent event) { return check(event.device); }

}  // namespace ferry
