#include "tensor/cuda.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "tensor/cuda_streams.h"
#include "tensor/emulated_cuda.h"

namespace ferry {
namespace {

// The process's CUDA runtime, made on first use unless one was set.
struct RuntimeSlot {
  absl::Mutex mu;
  std::shared_ptr<CudaRuntime> runtime ABSL_GUARDED_BY(mu);
};

RuntimeSlot& runtime_slot() {
  static RuntimeSlot slot;
  return slot;
}

// The calling thread's innermost CudaStreamScope.
thread_local const CudaStreamScope* innermost_scope = nullptr;

}  // namespace

CudaStreamScope::CudaStreamScope(CudaStream stream) : outer_(innermost_scope), stream_(stream) {
  innermost_scope = this;
}

CudaStreamScope::~CudaStreamScope() { innermost_scope = outer_; }

CudaStream current_cuda_stream(int device) {
  for (const CudaStreamScope* s = innermost_scope; s != nullptr; s = s->outer_) {
    if (s->stream_.device == device) return s->stream_;
  }
  return CudaStream{device, nullptr};
}

absl::Status wait_for_default_stream(CudaStream stream) {
  if (stream.handle == nullptr) return absl::OkStatus();  // the default stream itself
  return order_after(*cuda_runtime(), stream, CudaStream{stream.device, nullptr});
}

namespace internal {
// cuda_real.cc or cuda_none.cc, whichever this build compiled.
std::shared_ptr<CudaRuntime> make_builtin_cuda_runtime();
}  // namespace internal

std::shared_ptr<CudaRuntime> make_default_cuda_runtime() {
  const char* emulate = std::getenv("FERRY_EMULATE_CUDA");
  if (emulate == nullptr || *emulate == '\0') return internal::make_builtin_cuda_runtime();
  int devices = 0;
  absl::StatusOr<EmulatedCudaOptions> options = EmulatedCudaOptions::from_environment();
  if (!absl::SimpleAtoi(emulate, &devices) || devices < 0 || devices > 64) {
    options = absl::InvalidArgumentError(
        absl::StrCat("FERRY_EMULATE_CUDA=\"", emulate, "\": expected a device count from 0 to 64"));
  }
  if (!options.ok()) {
    // A runtime with no device, whose reason names the bad variable: every CUDA use
    // then fails saying so.
    FERRY_LOG(ERROR) << options.status().message();
    return std::make_shared<EmulatedCudaRuntime>(0);
  }
  return std::make_shared<EmulatedCudaRuntime>(devices, *options);
}

std::shared_ptr<CudaRuntime> cuda_runtime() {
  RuntimeSlot& slot = runtime_slot();
  absl::MutexLock lock(&slot.mu);
  if (!slot.runtime) slot.runtime = make_default_cuda_runtime();
  return slot.runtime;
}

std::shared_ptr<CudaRuntime> set_cuda_runtime(std::shared_ptr<CudaRuntime> runtime) {
  RuntimeSlot& slot = runtime_slot();
  absl::MutexLock lock(&slot.mu);
  std::shared_ptr<CudaRuntime> previous = std::move(slot.runtime);
  slot.runtime = std::move(runtime);
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

std::string cuda_missing_in_child() {
  int fds[2];
  if (pipe(fds) != 0) return absl::StrCat("cannot ask a child process about CUDA: pipe(): ", std::strerror(errno));
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::StrCat("cannot ask a child process about CUDA: fork(): ", std::strerror(errno));
  }
  if (pid == 0) {
    close(fds[0]);
    std::shared_ptr<CudaRuntime> cuda = cuda_runtime();
    std::string why;
    if (cuda->device_count() == 0) {
      why = cuda->unavailable_reason();
      if (why.empty()) why = "the CUDA runtime reports no device";
    }
    for (size_t done = 0; done < why.size();) {
      ssize_t n = write(fds[1], why.data() + done, why.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string why;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) why.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "the process asking CUDA for its devices failed";
  return why;
}

// A runtime that has no inter-process memory says so on every IPC call.
namespace {
absl::Status no_ipc(const char* call) {
  return absl::UnimplementedError(absl::StrCat(call, ": this CUDA runtime cannot share memory between processes"));
}
}  // namespace

absl::StatusOr<int> CudaRuntime::export_pool(int) { return no_ipc("export_pool"); }
absl::StatusOr<CudaImportedPool> CudaRuntime::import_pool(int) { return no_ipc("import_pool"); }
void CudaRuntime::release_imported_pool(CudaImportedPool) {}
absl::StatusOr<CudaPointerExport> CudaRuntime::export_pointer(void*) { return no_ipc("export_pointer"); }
absl::StatusOr<void*> CudaRuntime::import_pointer(CudaImportedPool, const CudaPointerExport&) {
  return no_ipc("import_pointer");
}
absl::Status CudaRuntime::release_imported_pointer(void*, CudaStream) { return no_ipc("release_imported_pointer"); }
absl::StatusOr<std::vector<CudaEvent>> CudaRuntime::create_ipc_events(int, int) {
  return no_ipc("create_ipc_events");
}
absl::StatusOr<CudaIpcEvents> CudaRuntime::export_ipc_events(std::span<const CudaEvent>) {
  return no_ipc("export_ipc_events");
}
absl::StatusOr<std::vector<CudaEvent>> CudaRuntime::import_ipc_events(int, int, std::string_view) {
  return no_ipc("import_ipc_events");
}

}  // namespace ferry
