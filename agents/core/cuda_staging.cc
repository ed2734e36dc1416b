#include "agents/core/cuda_staging.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

// Idle pinned buffers kept for reuse, at most.
constexpr size_t kMaxCachedPinnedBytes = size_t{256} << 20;

std::string device_list(const std::vector<Device>& devices) {
  if (devices.empty()) return "none";
  std::vector<std::string> names;
  for (const Device& d : devices) names.push_back(d.to_string());
  return absl::StrJoin(names, ", ");
}

}  // namespace

// Page-locked host buffers by size, reused: allocating pinned memory costs far more
// than the copy it serves. A buffer returns here when the last tensor using it dies.
class CudaStaging::PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  explicit PinnedPool(std::shared_ptr<CudaRuntime> runtime) : runtime_(std::move(runtime)) {}
  ~PinnedPool() {
    for (auto& [size, ptr] : idle_) runtime_->deallocate_pinned(ptr);
  }

  absl::StatusOr<Tensor> get(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    void* ptr = nullptr;
    size_t size = std::max<size_t>(bytes, 1);
    {
      absl::MutexLock lock(&mu_);
      auto it = idle_.lower_bound(size);
      // A buffer at most twice the size asked for, so small copies do not pin big ones.
      if (it != idle_.end() && it->first <= 2 * size) {
        size = it->first;
        ptr = it->second;
        cached_ -= size;
        idle_.erase(it);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (ptr == nullptr) {
      FERRY_ASSIGN_OR_RETURN(ptr, runtime_->allocate_pinned(size));
    }
    std::weak_ptr<PinnedPool> weak = weak_from_this();
    std::shared_ptr<CudaRuntime> runtime = runtime_;
    std::shared_ptr<void> storage(ptr, [weak, runtime, size](void* p) {
      if (std::shared_ptr<PinnedPool> pool = weak.lock()) {
        pool->put(p, size);
      } else {
        runtime->deallocate_pinned(p);
      }
    });
    return Tensor::from_blob(std::move(storage), {static_cast<int64_t>(bytes)}, DType::kUInt8);
  }

  uint64_t hits() const {
    absl::MutexLock lock(&mu_);
    return hits_;
  }
  uint64_t misses() const {
    absl::MutexLock lock(&mu_);
    return misses_;
  }

 private:
  void put(void* ptr, size_t size) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (cached_ + size <= kMaxCachedPinnedBytes) {
        idle_.emplace(size, ptr);
        cached_ += size;
        return;
      }
    }
    runtime_->deallocate_pinned(ptr);
  }

  const std::shared_ptr<CudaRuntime> runtime_;
  mutable absl::Mutex mu_;
  std::multimap<size_t, void*> idle_ ABSL_GUARDED_BY(mu_);
  size_t cached_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
};

CudaStaging::CudaStaging(std::vector<Device> devices)
    : runtime_(cuda_runtime()), pinned_(std::make_shared<PinnedPool>(runtime_)) {
  set_devices(std::move(devices));
}

CudaStaging::~CudaStaging() {
  for (auto& [device, stream] : streams_) runtime_->destroy_stream(stream);
}

void CudaStaging::set_devices(std::vector<Device> devices) {
  std::erase_if(devices, [](const Device& d) { return d.is_cpu(); });
  std::sort(devices.begin(), devices.end(), [](const Device& a, const Device& b) { return a.index() < b.index(); });
  absl::MutexLock lock(&mu_);
  devices_ = std::move(devices);
}

std::vector<Device> CudaStaging::devices() const {
  absl::MutexLock lock(&mu_);
  return devices_;
}

absl::Status CudaStaging::check_handled(Device device, std::string_view what) const {
  absl::MutexLock lock(&mu_);
  if (std::find(devices_.begin(), devices_.end(), device) != devices_.end()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(av(what), " is on ", device.to_string(),
                                                 ", which is not among this worker's devices (", device_list(devices_),
                                                 "); list it with options.set_devices or in a device map"));
}

absl::StatusOr<CudaStream> CudaStaging::stream_for(int device) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(device);
  if (it != streams_.end()) return it->second;
  FERRY_ASSIGN_OR_RETURN(CudaStream stream, runtime_->create_stream(device));
  streams_.emplace(device, stream);
  return stream;
}

absl::Status CudaStaging::stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets,
                                         const DeviceMap* map, std::string_view peer) {
  targets.assign(tensors.size(), std::string());
  std::set<int> used;
  for (size_t i = 0; i < tensors.size(); ++i) {
    Device device = tensors[i].device();
    if (device.is_cpu()) continue;
    const Device* target = nullptr;
    if (map != nullptr) {
      auto it = map->find(device);
      if (it != map->end()) target = &it->second;
    }
    if (target == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a tensor on ", device.to_string(), " cannot be sent to worker \"", av(peer),
          "\": the device map has no entry for ", device.to_string(), " (set one with options.set_device_map(\"",
          av(peer), "\", ...))"));
    }
    FERRY_RETURN_IF_ERROR(check_handled(device, absl::StrCat("a tensor for worker \"", av(peer), "\"")));
    FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device.index()));
    // The staging stream starts after what the producer (the default stream) queued.
    FERRY_ASSIGN_OR_RETURN(CudaEvent produced, runtime_->create_event(device.index()));
    absl::Status ordered = runtime_->record(produced, CudaStream{device.index(), nullptr});
    if (ordered.ok()) ordered = runtime_->wait(stream, produced);
    runtime_->destroy_event(produced);
    FERRY_RETURN_IF_ERROR(ordered);
    FERRY_ASSIGN_OR_RETURN(Tensor host, pinned_->get(tensors[i].nbytes()));
    FERRY_RETURN_IF_ERROR(
        runtime_->copy_async(host.data(), Device::cpu(), tensors[i].data(), device, tensors[i].nbytes(), stream));
    used.insert(device.index());
    tensors[i] = std::move(host);
    targets[i] = target->to_string();
  }
  // The write may start only once the bytes are in host memory.
  for (int device : used) {
    FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device));
    FERRY_RETURN_IF_ERROR(runtime_->synchronize(stream));
  }
  return absl::OkStatus();
}

absl::Status CudaStaging::land_incoming(std::vector<Tensor>& buffers, const std::vector<std::string>& targets) {
  std::set<int> used;
  std::vector<Tensor> sources;  // the host buffers live until their copies are done
  for (size_t i = 0; i < buffers.size() && i < targets.size(); ++i) {
    // Another channel's tensors are that channel's to land.
    if (targets[i].empty() || channel_of_target(targets[i]) != name()) continue;
    FERRY_ASSIGN_OR_RETURN(Device device, Device::parse(targets[i]));
    if (device.is_cpu()) continue;
    absl::Status handled = check_handled(device, "a received tensor");
    if (!handled.ok()) {
      return absl::Status(handled.code(), absl::StrCat("a received tensor could not be placed on ", targets[i], ": ",
                                                       handled.message()));
    }
    FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device.index()));
    absl::StatusOr<Tensor> landed = Tensor::empty(buffers[i].shape(), buffers[i].dtype(), device);
    if (!landed.ok()) {
      return absl::Status(landed.status().code(), absl::StrCat("a received tensor could not be placed on ",
                                                               targets[i], ": ", landed.status().message()));
    }
    FERRY_RETURN_IF_ERROR(runtime_->copy_async(landed->data(), device, buffers[i].data(), Device::cpu(),
                                               buffers[i].nbytes(), stream));
    used.insert(device.index());
    sources.push_back(std::move(buffers[i]));
    buffers[i] = *std::move(landed);
  }
  for (int device : used) {
    FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device));
    // Consumers on the default stream run after the copies; the host waits too, so the
    // tensors are usable once the message is handed on.
    FERRY_ASSIGN_OR_RETURN(CudaEvent copied, runtime_->create_event(device));
    absl::Status done = runtime_->record(copied, stream);
    if (done.ok()) done = runtime_->wait(CudaStream{device, nullptr}, copied);
    if (done.ok()) done = runtime_->synchronize(copied);
    runtime_->destroy_event(copied);
    FERRY_RETURN_IF_ERROR(done);
  }
  return absl::OkStatus();
}

std::map<std::string, std::string> CudaStaging::debug_info() const {
  return {{"pinned_buffer_hits", std::to_string(pinned_hits())}, {"pinned_buffer_misses", std::to_string(pinned_misses())}};
}

uint64_t CudaStaging::pinned_hits() const { return pinned_->hits(); }
uint64_t CudaStaging::pinned_misses() const { return pinned_->misses(); }

}  // namespace ferry::internal
