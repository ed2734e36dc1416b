#include "tensor/cuda.h"

#include <mutex>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

std::mutex& runtime_mutex() {
  static std::mutex mu;
  return mu;
}

std::shared_ptr<CudaRuntime>& runtime_slot() {
  static std::shared_ptr<CudaRuntime> runtime;
  return runtime;
}

}  // namespace

std::shared_ptr<CudaRuntime> cuda_runtime() {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  auto& slot = runtime_slot();
  if (!slot) slot = make_default_cuda_runtime();
  return slot;
}

std::shared_ptr<CudaRuntime> set_cuda_runtime(std::shared_ptr<CudaRuntime> runtime) {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  auto& slot = runtime_slot();
  std::shared_ptr<CudaRuntime> previous = std::move(slot);
  slot = std::move(runtime);
  return previous;
}

absl::Status check_device_available(Device device) {
  if (device.is_cpu()) return absl::OkStatus();
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  int count = runtime->device_count();
  if (count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.to_string(), " requested but no CUDA device is available: ",
        runtime->unavailable_reason()));
  }
  if (device.index() >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device ", device.to_string(),
                                                   " out of range: this process has ", count,
                                                   " CUDA device(s), cuda:0 to cuda:", count - 1));
  }
  return absl::OkStatus();
}

}  // namespace ferry
