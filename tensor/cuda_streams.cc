#include "tensor/cuda_streams.h"

#include <utility>

namespace ferry {

absl::Status order_after(CudaRuntime& runtime, CudaStream waiter, CudaStream signaller) {
  absl::StatusOr<CudaEvent> event = runtime.create_event(signaller.device);
  if (!event.ok()) return event.status();
  absl::Status ordered = runtime.record(*event, signaller);
  if (ordered.ok()) ordered = runtime.wait(waiter, *event);
  runtime.destroy_event(*event);
  return ordered;
}

CudaStreams::~CudaStreams() {
  std::map<int, CudaStream> streams;
  {
    absl::MutexLock lock(&mu_);
    streams.swap(streams_);
  }
  for (auto& [device, stream] : streams) {
    (void)runtime_->synchronize(stream);
    runtime_->destroy_stream(stream);
  }
}

absl::StatusOr<CudaStream> CudaStreams::get(int device) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(device);
  if (it != streams_.end()) return it->second;
  absl::StatusOr<CudaStream> made = runtime_->create_stream(device);
  if (!made.ok()) return made.status();
  streams_.emplace(device, *made);
  return *made;
}

void CudaStreams::synchronize() {
  std::map<int, CudaStream> streams;
  {
    absl::MutexLock lock(&mu_);
    streams = streams_;
  }
  for (auto& [device, stream] : streams) (void)runtime_->synchronize(stream);
}

}  // namespace ferry
