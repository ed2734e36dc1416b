// The runtime of a build without CUDA: no devices, every operation an error.
#include "absl/status/status.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

constexpr char kReason[] =
    "ferry was built without CUDA support (configure with -DFERRY_WITH_CUDA=ON and a CUDA toolkit)";

class NoCudaRuntime final : public CudaRuntime {
 public:
  int device_count() override { return 0; }
  std::string unavailable_reason() override { return kReason; }
  absl::StatusOr<void*> allocate(int, size_t) override { return error(); }
  void deallocate(int, void*) override {}
  absl::StatusOr<void*> allocate_async(int, size_t, CudaStream) override { return error(); }
  void deallocate_async(int, void*, CudaStream) override {}
  CudaPoolStats pool_stats(int) override { return {}; }
  absl::StatusOr<void*> allocate_pinned(size_t) override { return error(); }
  void deallocate_pinned(void*) override {}
  absl::Status copy_async(void*, Device, const void*, Device, size_t, CudaStream) override { return error(); }
  absl::StatusOr<CudaStream> create_stream(int) override { return error(); }
  void destroy_stream(CudaStream) override {}
  absl::Status synchronize(CudaStream) override { return error(); }
  absl::StatusOr<CudaEvent> create_event(int) override { return error(); }
  void destroy_event(CudaEvent) override {}
  absl::Status record(CudaEvent, CudaStream) override { return error(); }
  absl::Status wait(CudaStream, CudaEvent) override { return error(); }
  absl::Status synchronize(CudaEvent) override { return error(); }
  absl::StatusOr<bool> query(CudaEvent) override { return error(); }

 private:
  static absl::Status error() { return absl::FailedPreconditionError(kReason); }
};

}  // namespace

namespace internal {
std::shared_ptr<CudaRuntime> make_builtin_cuda_runtime() { return std::make_shared<NoCudaRuntime>(); }
}  // namespace internal

}  // namespace ferry
