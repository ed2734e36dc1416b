// File: tensor/host_backed_cuda.h
//
// HostBackedCudaRuntime: a CudaRuntime whose N "CUDA devices" are host memory. Tests
// on machines without a GPU install it to run the same device routing (device maps,
// staging, reverse maps) that a real GPU would, with every copy a memcpy done at once
// and streams and events trivially complete.
//
//   auto previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2));
//   Tensor t = *Tensor::zeros({4}, DType::kFloat32, Device::cuda(1));
#pragma once

#include "tensor/cuda.h"

namespace ferry {

// Thread-safe.
class HostBackedCudaRuntime final : public CudaRuntime {
 public:
  explicit HostBackedCudaRuntime(int device_count) : device_count_(device_count) {}

  int device_count() override { return device_count_; }
  std::string unavailable_reason() override;
  absl::StatusOr<void*> allocate(int device, size_t bytes) override;
  void deallocate(int device, void* ptr) override;
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

 private:
  absl::Status check(int device) const;
  const int device_count_;
};

}  // namespace ferry
