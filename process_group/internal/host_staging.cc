#include "process_group/internal/host_staging.h"

#include <cstring>
#include <memory>

#include "base/status.h"
#include "tensor/cuda.h"

namespace ferry::internal::pg {

absl::StatusOr<Tensor> host_input(const Tensor& t) { return t.to(Device::cpu()); }

absl::StatusOr<Tensor> host_output(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  return Tensor::empty(t.shape(), t.dtype(), Device::cpu());
}

absl::Status copy_from_host(const Tensor& dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst.data() == src) return absl::OkStatus();
  if (dst.device().is_cpu()) {
    std::memcpy(dst.data(), src, bytes);
    return absl::OkStatus();
  }
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  CudaStream stream{dst.device().index(), nullptr};
  FERRY_RETURN_IF_ERROR(runtime->copy_async(dst.data(), dst.device(), src, Device::cpu(), bytes, stream));
  return runtime->synchronize(stream);
}

absl::Status write_back(const Tensor& t, const Tensor& host) { return copy_from_host(t, host.data(), t.nbytes()); }

}  // namespace ferry::internal::pg
