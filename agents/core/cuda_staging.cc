#include "agents/core/cuda_staging.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

// Idle pinned buffers kept for reuse, at most.
constexpr size_t kMaxCachedPinnedBytes = size_t{256} << 20;

// Offsets inside a shared slot keep every tensor aligned as CUDA allocations are.
constexpr size_t kSlotAlignment = 256;

size_t aligned(size_t bytes) { return (bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment; }

// A host tensor of `like`'s shape and dtype over `bytes` inside `slot`, sharing its owner.
absl::StatusOr<Tensor> view_of(const Tensor& slot, size_t offset, const Tensor& like) {
  std::shared_ptr<void> at(slot.storage(), static_cast<char*>(slot.data()) + offset);
  return Tensor::from_blob(std::move(at), like.shape(), like.dtype());
}

std::string device_list(const std::vector<Device>& devices) {
  if (devices.empty()) return "none";
  std::vector<std::string> names;
  for (const Device& d : devices) names.push_back(d.to_string());
  return absl::StrJoin(names, ", ");
}

}  // namespace

// Page-locked host slots by size, reused: allocating pinned memory costs far more than
// the copy it serves. A slot returns here when the last tensor using it dies; every
// copy into it has passed by then (the staging waits for its copies before it hands
// the slot's tensors on).
class CudaStaging::PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  explicit PinnedPool(std::shared_ptr<CudaRuntime> runtime) : runtime_(std::move(runtime)) {}
  ~PinnedPool() {
    for (auto& [size, ptr] : idle_) runtime_->deallocate_pinned(ptr);
  }

  // A slot of at least `bytes` bytes, as a flat uint8 host tensor.
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
  std::deque<Retired> retired;
  std::map<int, CudaStream> streams;
  {
    absl::MutexLock lock(&mu_);
    retired.swap(retired_);
    streams.swap(streams_);
  }
  for (Retired& r : retired) {
    (void)runtime_->synchronize(r.copied);
    runtime_->destroy_event(r.copied);
  }
  for (auto& [device, stream] : streams) {
    (void)runtime_->synchronize(stream);
    runtime_->destroy_stream(stream);
  }
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

absl::Status CudaStaging::order_after(CudaStream waiter, CudaStream signaller) {
  FERRY_ASSIGN_OR_RETURN(CudaEvent event, runtime_->create_event(signaller.device));
  absl::Status ordered = runtime_->record(event, signaller);
  if (ordered.ok()) ordered = runtime_->wait(waiter, event);
  runtime_->destroy_event(event);
  return ordered;
}

void CudaStaging::retire_passed() {
  std::vector<Retired> done;
  {
    absl::MutexLock lock(&mu_);
    while (!retired_.empty()) {
      absl::StatusOr<bool> passed = runtime_->query(retired_.front().copied);
      // An error leaves the buffers held: the destructor synchronizes before dropping them.
      if (!passed.ok() || !*passed) break;
      done.push_back(std::move(retired_.front()));
      retired_.pop_front();
    }
  }
  for (Retired& r : done) runtime_->destroy_event(r.copied);
}

absl::Status CudaStaging::stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets,
                                         const DeviceMap* map, std::string_view peer) {
  retire_passed();
  targets.assign(tensors.size(), std::string());
  // Every device tensor is checked before any copy is queued.
  std::map<int, std::vector<size_t>> by_device;
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
    targets[i] = target->to_string();
    by_device[device.index()].push_back(i);
  }
  if (by_device.empty()) return absl::OkStatus();

  // The device tensors stay referenced until their copies have passed: dropped earlier,
  // their memory would return to the pool on the default stream while the staging
  // stream still reads it.
  std::vector<Tensor> sources;
  std::vector<std::pair<int, CudaEvent>> copied;
  absl::Status queued = absl::OkStatus();
  for (auto& [device, indices] : by_device) {
    absl::StatusOr<CudaStream> stream = stream_for(device);
    if (!stream.ok()) {
      queued = stream.status();
      break;
    }
    // The staging stream starts after what the producer (the default stream) queued.
    queued = order_after(*stream, CudaStream{device, nullptr});
    if (!queued.ok()) break;
    // Small tensors share one slot; each large one has its own.
    size_t shared_bytes = 0;
    for (size_t i : indices) {
      if (tensors[i].nbytes() < kSharedSlotBytes) shared_bytes += aligned(tensors[i].nbytes());
    }
    Tensor shared;
    if (shared_bytes > 0) {
      absl::StatusOr<Tensor> slot = pinned_->get(shared_bytes);
      if (!slot.ok()) {
        queued = slot.status();
        break;
      }
      shared = *std::move(slot);
    }
    size_t offset = 0;
    for (size_t i : indices) {
      const size_t bytes = tensors[i].nbytes();
      absl::StatusOr<Tensor> host;
      if (bytes < kSharedSlotBytes) {
        host = view_of(shared, offset, tensors[i]);
        offset += aligned(bytes);
      } else {
        absl::StatusOr<Tensor> slot = pinned_->get(bytes);
        host = slot.ok() ? view_of(*slot, 0, tensors[i]) : absl::StatusOr<Tensor>(slot.status());
      }
      if (host.ok()) {
        queued = runtime_->copy_async(host->data(), Device::cpu(), tensors[i].data(), Device::cuda(device), bytes,
                                      *stream);
      } else {
        queued = host.status();
      }
      if (!queued.ok()) break;
      sources.push_back(std::move(tensors[i]));
      tensors[i] = *std::move(host);
    }
    if (!queued.ok()) break;
    // One event per device and message; the write may start only once it has passed.
    absl::StatusOr<CudaEvent> event = runtime_->create_event(device);
    if (event.ok()) {
      copied.emplace_back(device, *event);
      queued = runtime_->record(*event, *stream);
    } else {
      queued = event.status();
    }
    if (!queued.ok()) break;
    absl::MutexLock lock(&mu_);
    staged_tensors_ += indices.size();
    if (shared_bytes > 0) ++shared_slots_;
  }
  // Even after an error, the copies already queued must pass before their memory goes.
  for (auto& [device, event] : copied) {
    absl::Status done = runtime_->synchronize(event);
    if (queued.ok()) queued = done;
    runtime_->destroy_event(event);
  }
  if (!queued.ok()) {
    for (auto& [device, indices] : by_device) {
      FERRY_RETURN_IF_ERROR(runtime_->synchronize(CudaStream{device, nullptr}));
      if (absl::StatusOr<CudaStream> stream = stream_for(device); stream.ok()) {
        FERRY_RETURN_IF_ERROR(runtime_->synchronize(*stream));
      }
    }
  }
  return queued;
}

absl::Status CudaStaging::land_incoming(std::vector<Tensor>& buffers, const std::vector<std::string>& targets) {
  retire_passed();
  std::map<int, std::vector<size_t>> by_device;
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
    by_device[device.index()].push_back(i);
  }
  for (auto& [device, indices] : by_device) {
    FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device));
    // Pool memory, allocated on the default stream (where the tensors will be dropped).
    std::vector<Tensor> landed;
    for (size_t i : indices) {
      absl::StatusOr<Tensor> t = Tensor::empty(buffers[i].shape(), buffers[i].dtype(), Device::cuda(device));
      if (!t.ok()) {
        return absl::Status(t.status().code(), absl::StrCat("a received tensor could not be placed on ",
                                                            targets[i], ": ", t.status().message()));
      }
      landed.push_back(*std::move(t));
    }
    // The copies start after the allocations, in the default stream's order.
    FERRY_RETURN_IF_ERROR(order_after(stream, CudaStream{device, nullptr}));
    Retired retired;
    for (size_t k = 0; k < indices.size(); ++k) {
      Tensor& source = buffers[indices[k]];
      absl::Status copy = runtime_->copy_async(landed[k].data(), Device::cuda(device), source.data(), Device::cpu(),
                                               source.nbytes(), stream);
      if (!copy.ok()) {
        // What was queued must pass before its buffers go.
        (void)runtime_->synchronize(stream);
        return copy;
      }
      // The host buffer is held until the copy has passed.
      retired.held.push_back(std::move(source));
      source = std::move(landed[k]);
    }
    // Consumers on the default stream run after the copies; the host does not wait.
    FERRY_ASSIGN_OR_RETURN(retired.copied, runtime_->create_event(device));
    absl::Status done = runtime_->record(retired.copied, stream);
    if (done.ok()) done = runtime_->wait(CudaStream{device, nullptr}, retired.copied);
    if (!done.ok()) {
      (void)runtime_->synchronize(stream);
      runtime_->destroy_event(retired.copied);
      return done;
    }
    absl::MutexLock lock(&mu_);
    landed_tensors_ += indices.size();
    retired_.push_back(std::move(retired));
  }
  return absl::OkStatus();
}

std::map<std::string, std::string> CudaStaging::debug_info() const {
  std::map<std::string, std::string> info = {{"pinned_buffer_hits", std::to_string(pinned_hits())},
                                             {"pinned_buffer_misses", std::to_string(pinned_misses())}};
  std::vector<Device> devices;
  {
    absl::MutexLock lock(&mu_);
    info["staging_tensors_sent"] = std::to_string(staged_tensors_);
    info["staging_shared_slots"] = std::to_string(shared_slots_);
    info["staging_tensors_landed"] = std::to_string(landed_tensors_);
    devices = devices_;
  }
  // The device pools this worker uses: what they served, and what reached the driver.
  for (const Device& d : devices) {
    CudaPoolStats stats = runtime_->pool_stats(d.index());
    std::string prefix = absl::StrCat("cuda_pool.", d.to_string(), ".");
    info[prefix + "allocations"] = std::to_string(stats.allocations);
    info[prefix + "bytes"] = std::to_string(stats.bytes);
    info[prefix + "driver_allocations"] = std::to_string(stats.driver_allocations);
    info[prefix + "driver_bytes"] = std::to_string(stats.driver_bytes);
  }
  return info;
}

uint64_t CudaStaging::pinned_hits() const { return pinned_->hits(); }
uint64_t CudaStaging::pinned_misses() const { return pinned_->misses(); }

}  // namespace ferry::internal
