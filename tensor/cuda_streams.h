// File: tensor/cuda_streams.h
//
// CudaStreams: one stream of a component's own per device, made at first use and kept
// until the component goes, so that its copies neither queue behind the user's work on
// the default stream nor pay for a stream per message (the staging and cuda_ipc device
// channels each keep one set). And order_after: one stream waits, without blocking the
// host, for what another has queued so far.
//
//   CudaStreams streams(cuda_runtime());
//   FERRY_ASSIGN_OR_RETURN(CudaStream s, streams.get(0));
//   FERRY_RETURN_IF_ERROR(order_after(*runtime, s, CudaStream{0, nullptr}));
//   ... copies on s ...
#pragma once

#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tensor/cuda.h"

namespace ferry {

// Makes `waiter` wait for what `signaller` has queued so far (an event recorded on one,
// waited on by the other, then destroyed). Errors: the runtime's.
absl::Status order_after(CudaRuntime& runtime, CudaStream waiter, CudaStream signaller);

// Thread-safe. Holds its own reference to the runtime.
class CudaStreams {
 public:
  explicit CudaStreams(std::shared_ptr<CudaRuntime> runtime) : runtime_(std::move(runtime)) {}
  // Waits for each stream to pass what was queued on it, then destroys it.
  ~CudaStreams();
  CudaStreams(const CudaStreams&) = delete;
  CudaStreams& operator=(const CudaStreams&) = delete;

  // The stream of `device`, made on first use. Errors: the runtime's create_stream.
  absl::StatusOr<CudaStream> get(int device) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits on the host for every stream to pass what was queued on it so far (errors
  // ignored: a stream that cannot be waited for has nothing left to run). For an owner
  // that must drop memory those streams still use.
  void synchronize() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::shared_ptr<CudaRuntime> runtime_;
  absl::Mutex mu_;
  std::map<int, CudaStream> streams_ ABSL_GUARDED_BY(mu_);  // by device index
};

}  // namespace ferry
