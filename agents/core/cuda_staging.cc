#include "agents/core/cuda_staging.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/logging.h"
#include "base/status.h"
#include "serialization/archive.h"
#include "serialization/message.h"

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

// A placeholder's target starts so: "staging|<transfer>|<dtype>|<d0>,<d1>,...".
constexpr char kPlaceholder[] = "staging|";
// A kChunk message's payload: the chunk's offset in its tensor, and the tensor's bytes.
constexpr size_t kChunkPayload = 16;

std::string placeholder_target(uint64_t transfer, const Tensor& t) {
  return absl::StrCat(kPlaceholder, transfer, "|", dtype_name(t.dtype()), "|", absl::StrJoin(t.shape(), ","));
}

Wire chunk_wire(uint64_t transfer, uint64_t offset, uint64_t total, const std::string& target, Tensor piece) {
  Message m(MessageType::kChunk, transfer);
  char payload[kChunkPayload];
  std::memcpy(payload, &offset, 8);
  std::memcpy(payload + 8, &total, 8);
  m.buffer().append(payload, kChunkPayload);
  Wire wire;
  wire.metadata = m.seal();
  wire.tensors.push_back(std::move(piece));
  wire.targets.push_back(target);
  return wire;
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
  std::map<TransferKey, Transfer> transfers;
  {
    absl::MutexLock lock(&mu_);
    retired.swap(retired_);
    transfers.swap(transfers_);
  }
  for (Retired& r : retired) {
    (void)runtime_->synchronize(r.copied);
    runtime_->destroy_event(r.copied);
  }
  // Unfinished transfers' memory goes only once the streams copying into it passed;
  // the streams themselves go with streams_.
  streams_.synchronize();
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

size_t CudaStaging::chunk_bytes(size_t bytes) {
  static const size_t forced = [] {
    const char* v = std::getenv("FERRY_STAGING_CHUNK_KB");
    size_t kb = 0;
    if (v != nullptr && *v != '\0' && (!absl::SimpleAtoi(v, &kb) || kb == 0 || kb > (size_t{1} << 20))) {
      FERRY_LOG(WARNING) << "FERRY_STAGING_CHUNK_KB=\"" << v << "\" ignored: expected KiB from 1 to 1048576";
      kb = 0;
    }
    return kb << 10;
  }();
  if (forced != 0) return forced;
  // Eight chunks or more, each small enough to stay in cache between the copy that
  // fills it and the one that drains it.
  constexpr size_t kMin = size_t{256} << 10, kMax = size_t{1} << 20;
  return std::clamp(aligned(bytes / 8), kMin, kMax);
}

absl::Status CudaStaging::stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets,
                                         const DeviceMap* map, std::string_view peer, WriteAhead write_ahead) {
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
    // The staging stream starts after what the producer (the default stream, or the
    // caller's CudaStreamScope) queued.
    queued = order_after(*stream, current_cuda_stream(device));
    if (!queued.ok()) break;
    // Small tensors share one slot; each large one has its own; the largest stream.
    size_t shared_bytes = 0;
    std::vector<size_t> chunked;
    for (size_t i : indices) {
      if (tensors[i].nbytes() < kSharedSlotBytes) shared_bytes += aligned(tensors[i].nbytes());
      if (tensors[i].nbytes() >= kChunkedBytes) chunked.push_back(i);
    }
    std::erase_if(indices, [&](size_t i) { return tensors[i].nbytes() >= kChunkedBytes; });
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
    // Chunked tensors stream behind the copies above, on the same stream.
    for (size_t i : chunked) {
      uint64_t transfer = 0;
      {
        absl::MutexLock lock(&mu_);
        transfer = ++next_transfer_;
      }
      queued = stream_chunks(tensors[i], device, *stream, transfer, targets[i], write_ahead);
      if (!queued.ok()) break;
      targets[i] = placeholder_target(transfer, tensors[i]);
      absl::StatusOr<Tensor> placeholder = Tensor::empty({0}, DType::kUInt8);
      if (!placeholder.ok()) {
        queued = placeholder.status();
        break;
      }
      tensors[i] = *std::move(placeholder);  // every copy out of it has passed
    }
    if (!queued.ok()) break;
    absl::MutexLock lock(&mu_);
    staged_tensors_ += indices.size() + chunked.size();
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
    if (targets[i].starts_with(kPlaceholder)) {
      return absl::DataLossError(absl::StrCat("a received tensor names chunked transfer \"", targets[i],
                                              "\", which was not claimed when its message arrived"));
    }
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

absl::Status CudaStaging::retire_after(CudaStream stream, std::vector<Tensor> held) {
  absl::StatusOr<CudaEvent> event = runtime_->create_event(stream.device);
  absl::Status recorded = event.ok() ? runtime_->record(*event, stream) : event.status();
  if (!recorded.ok()) {
    // Nothing to watch: the buffers go once the stream has passed.
    (void)runtime_->synchronize(stream);
    if (event.ok()) runtime_->destroy_event(*event);
    return recorded;
  }
  absl::MutexLock lock(&mu_);
  retired_.push_back(Retired{*event, std::move(held)});
  return absl::OkStatus();
}

absl::Status CudaStaging::stream_chunks(const Tensor& t, int device, CudaStream stream, uint64_t id,
                                        const std::string& target, WriteAhead write_ahead) {
  // A chunk whose copy is queued: the slot it lands in, held until written.
  struct Ahead {
    CudaEvent copied;
    Tensor slot;
    uint64_t offset = 0;
  };
  const uint64_t total = t.nbytes();
  const uint64_t chunk = chunk_bytes(total);
  const char* source = static_cast<const char*>(t.data());
  std::deque<Ahead> ahead;
  uint64_t queued_to = 0;
  auto queue_next = [&]() -> absl::Status {
    const uint64_t n = std::min(chunk, total - queued_to);
    FERRY_ASSIGN_OR_RETURN(Tensor slot, pinned_->get(n));
    FERRY_ASSIGN_OR_RETURN(CudaEvent copied, runtime_->create_event(device));
    ahead.push_back(Ahead{copied, std::move(slot), queued_to});
    queued_to += n;
    FERRY_RETURN_IF_ERROR(runtime_->copy_async(ahead.back().slot.data(), Device::cpu(),
                                               source + ahead.back().offset, Device::cuda(device), n, stream));
    return runtime_->record(copied, stream);
  };
  absl::Status status = absl::OkStatus();
  while (status.ok() && ahead.size() < kChunksAhead && queued_to < total) status = queue_next();
  uint64_t written = 0;
  while (status.ok() && !ahead.empty()) {
    Ahead a = std::move(ahead.front());
    ahead.pop_front();
    status = runtime_->synchronize(a.copied);
    runtime_->destroy_event(a.copied);
    if (!status.ok()) break;
    // The next copy is queued before this chunk is written, so that the two overlap.
    if (queued_to < total) status = queue_next();
    write_ahead(chunk_wire(id, a.offset, total, target, std::move(a.slot)));
    ++written;
  }
  if (!status.ok()) {
    // Copies still queued read the tensor and fill the slots: they pass first.
    (void)runtime_->synchronize(stream);
    for (Ahead& a : ahead) runtime_->destroy_event(a.copied);
  }
  absl::MutexLock lock(&mu_);
  chunks_sent_ += written;
  return status;
}

absl::StatusOr<CudaStaging::Transfer> CudaStaging::open_transfer(int peer, Device device, uint64_t total) {
  {
    absl::MutexLock lock(&mu_);
    size_t open = 0;
    for (auto it = transfers_.lower_bound({peer, 0}); it != transfers_.end() && it->first.first == peer; ++it) ++open;
    if (open >= kMaxOpenTransfers) {
      return absl::ResourceExhaustedError(absl::StrCat("worker id ", peer, " has ", open,
                                                       " chunked tensors unfinished here, the most a peer may have"));
    }
  }
  FERRY_ASSIGN_OR_RETURN(Tensor landed, Tensor::empty({static_cast<int64_t>(total)}, DType::kUInt8, device));
  FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device.index()));
  // The chunks' copies start after the allocation, in the default stream's order.
  FERRY_RETURN_IF_ERROR(order_after(stream, CudaStream{device.index(), nullptr}));
  return Transfer{std::move(landed), 0};
}

absl::Status CudaStaging::land_chunk(int peer, Wire wire) {
  retire_passed();
  if (wire.tensors.size() != 1 || wire.targets.size() != 1 ||
      wire.metadata.size() != Message::kHeaderSize + kChunkPayload) {
    return absl::DataLossError(absl::StrCat("a malformed chunk from worker id ", peer, ": ", wire.tensors.size(),
                                            " tensors, ", wire.metadata.size(),
                                            " bytes of header (expected 1 tensor and ",
                                            Message::kHeaderSize + kChunkPayload, " bytes)"));
  }
  FERRY_ASSIGN_OR_RETURN(Message header, Message::parse(std::move(wire.metadata), {}));
  uint64_t offset = 0, total = 0;
  std::memcpy(&offset, header.payload().data(), 8);
  std::memcpy(&total, header.payload().data() + 8, 8);
  Tensor& piece = wire.tensors[0];
  const uint64_t n = piece.nbytes();
  absl::StatusOr<Device> device = Device::parse(wire.targets[0]);
  if (!device.ok() || !device->is_cuda()) {
    return absl::DataLossError(absl::StrCat("a chunk from worker id ", peer, " targets \"", wire.targets[0],
                                            "\" (expected a CUDA device)"));
  }
  FERRY_RETURN_IF_ERROR(check_handled(*device, "a received chunk"));
  if (total > max_message_bytes() || offset > total || n > total - offset || !piece.device().is_cpu()) {
    return absl::DataLossError(absl::StrCat("a chunk from worker id ", peer, " of ", n, " bytes at offset ", offset,
                                            " of a ", total, "-byte tensor does not fit it (or the tensor exceeds ",
                                            max_message_bytes(), " bytes, FERRY_MAX_MESSAGE_BYTES)"));
  }
  const TransferKey key{peer, header.id()};
  Tensor landed;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = transfers_.find(key); it != transfers_.end()) landed = it->second.landed;
  }
  if (landed.storage() == nullptr) {
    FERRY_ASSIGN_OR_RETURN(Transfer opened, open_transfer(peer, *device, total));
    landed = opened.landed;
    absl::MutexLock lock(&mu_);
    transfers_.emplace(key, std::move(opened));
  }
  if (landed.device() != *device || landed.nbytes() != total) {
    return absl::DataLossError(absl::StrCat("chunks of transfer ", key.second, " from worker id ", peer,
                                            " disagree on their tensor's device or size"));
  }
  FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device->index()));
  FERRY_RETURN_IF_ERROR(runtime_->copy_async(static_cast<char*>(landed.data()) + offset, *device, piece.data(),
                                             Device::cpu(), n, stream));
  // The received buffer is held until its copy has passed.
  std::vector<Tensor> held;
  held.push_back(std::move(piece));
  FERRY_RETURN_IF_ERROR(retire_after(stream, std::move(held)));
  absl::MutexLock lock(&mu_);
  if (auto it = transfers_.find(key); it != transfers_.end()) it->second.received += n;
  ++chunks_landed_;
  return absl::OkStatus();
}

bool CudaStaging::names_chunked(const std::vector<std::string>& targets) {
  for (const std::string& t : targets) {
    if (t.starts_with(kPlaceholder)) return true;
  }
  return false;
}

absl::Status CudaStaging::claim_chunked(int peer, Wire& wire) {
  for (size_t i = 0; i < wire.targets.size() && i < wire.tensors.size(); ++i) {
    const std::string& target = wire.targets[i];
    if (!target.starts_with(kPlaceholder)) continue;
    std::vector<std::string> parts = absl::StrSplit(target, '|');
    uint64_t id = 0;
    absl::StatusOr<DType> dtype = parts.size() == 4 ? parse_dtype(parts[2]) : absl::InvalidArgumentError("");
    std::vector<int64_t> shape;
    bool shape_ok = dtype.ok();
    if (shape_ok && !parts[3].empty()) {
      for (absl::string_view d : absl::StrSplit(parts[3], ',')) {
        int64_t v = 0;
        shape_ok = shape_ok && absl::SimpleAtoi(d, &v) && v >= 0;
        shape.push_back(v);
      }
    }
    if (!shape_ok || !absl::SimpleAtoi(parts[1], &id)) {
      return absl::DataLossError(absl::StrCat("a malformed chunked tensor \"", target, "\" from worker id ", peer,
                                              " (expected staging|<transfer>|<dtype>|<shape>)"));
    }
    std::optional<Transfer> transfer;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = transfers_.find({peer, id}); it != transfers_.end()) {
        transfer = std::move(it->second);
        transfers_.erase(it);
      }
    }
    if (!transfer || transfer->received != transfer->landed.nbytes()) {
      return absl::DataLossError(absl::StrCat(
          "a message from worker id ", peer, " names chunked transfer ", id, ", of which ",
          transfer ? absl::StrCat(transfer->received, " of ", transfer->landed.nbytes(), " bytes") : std::string("nothing"),
          " arrived before it (its chunks must precede it on the connection)"));
    }
    const Device device = transfer->landed.device();
    absl::StatusOr<Tensor> view = Tensor::from_blob(transfer->landed.storage(), shape, *dtype, device);
    if (!view.ok() || view->nbytes() != transfer->landed.nbytes()) {
      return absl::DataLossError(absl::StrCat("chunked transfer ", id, " from worker id ", peer, " has ",
                                              transfer->landed.nbytes(), " bytes, which do not make the tensor \"",
                                              target, "\" names"));
    }
    // Consumers on the default stream run after every chunk's copy.
    FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device.index()));
    FERRY_RETURN_IF_ERROR(order_after(CudaStream{device.index(), nullptr}, stream));
    wire.tensors[i] = *std::move(view);
    wire.targets[i].clear();
    absl::MutexLock lock(&mu_);
    ++chunked_tensors_landed_;
  }
  return absl::OkStatus();
}

void CudaStaging::forget(int peer) {
  std::vector<Transfer> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = transfers_.lower_bound({peer, 0}); it != transfers_.end() && it->first.first == peer;) {
      dropped.push_back(std::move(it->second));
      it = transfers_.erase(it);
    }
  }
  for (Transfer& t : dropped) {
    // Their memory returns on the default stream, after the copies into it.
    absl::StatusOr<CudaStream> stream = stream_for(t.landed.device().index());
    if (!stream.ok() || !order_after(CudaStream{t.landed.device().index(), nullptr}, *stream).ok()) {
      (void)runtime_->synchronize(stream.ok() ? *stream : CudaStream{t.landed.device().index(), nullptr});
    }
  }
}

std::map<std::string, std::string> CudaStaging::debug_info() const {
  std::map<std::string, std::string> info = {{"pinned_buffer_hits", std::to_string(pinned_hits())},
                                             {"pinned_buffer_misses", std::to_string(pinned_misses())}};
  std::vector<Device> devices;
  {
    absl::MutexLock lock(&mu_);
    info["staging_tensors_sent"] = std::to_string(staged_tensors_);
    info["staging_shared_slots"] = std::to_string(shared_slots_);
    info["staging_tensors_landed"] = std::to_string(landed_tensors_ + chunked_tensors_landed_);
    info["staging_chunks_sent"] = std::to_string(chunks_sent_);
    info["staging_chunks_landed"] = std::to_string(chunks_landed_);
    info["staging_chunked_tensors_landed"] = std::to_string(chunked_tensors_landed_);
    info["staging_open_transfers"] = std::to_string(transfers_.size());
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

std::string CudaStaging::prometheus() const {
  std::map<std::string, std::string> info = debug_info();
  std::string text;
  auto series = [&](std::string_view name, std::string_view help) {
    absl::StrAppend(&text, "# HELP ", av(name), " ", av(help), "\n# TYPE ", av(name), " counter\n");
  };
  const std::vector<Device> handled = devices();
  constexpr std::string_view kPool[][3] = {
      {"ferry_cuda_pool_allocations_total", "allocations", "Device allocations served by the stream-ordered pool."},
      {"ferry_cuda_pool_bytes_total", "bytes", "Bytes of the allocations the pool served."},
      {"ferry_cuda_pool_driver_allocations_total", "driver_allocations",
       "Pool allocations that reached the driver (the pool grew)."},
      {"ferry_cuda_pool_driver_bytes_total", "driver_bytes", "Bytes the pool obtained from the driver."},
  };
  for (const auto& [name, key, help] : kPool) {
    series(name, help);
    for (const Device& d : handled) {
      absl::StrAppend(&text, av(name), "{device=\"", d.to_string(), "\"} ",
                      info[absl::StrCat("cuda_pool.", d.to_string(), ".", av(key))], "\n");
    }
  }
  constexpr std::string_view kStaging[][5] = {
      {"ferry_staging_pinned_total", "Page-locked staging slots reused (hit) or allocated (miss).",
       "outcome=\"hit\"", "pinned_buffer_hits", "pinned_buffer_misses"},
      {"ferry_staging_tensors_total", "Device tensors staged out (sent) and landed.", "direction=\"sent\"",
       "staging_tensors_sent", "staging_tensors_landed"},
      {"ferry_staging_chunks_total", "Chunks of large device tensors sent and landed.", "direction=\"sent\"",
       "staging_chunks_sent", "staging_chunks_landed"},
  };
  for (const auto& [name, help, first, first_key, second_key] : kStaging) {
    series(name, help);
    const std::string_view second = first.starts_with("outcome") ? "outcome=\"miss\"" : "direction=\"landed\"";
    absl::StrAppend(&text, av(name), "{", av(first), "} ", info[std::string(first_key)], "\n");
    absl::StrAppend(&text, av(name), "{", av(second), "} ", info[std::string(second_key)], "\n");
  }
  return text;
}

uint64_t CudaStaging::pinned_hits() const { return pinned_->hits(); }
uint64_t CudaStaging::pinned_misses() const { return pinned_->misses(); }

}  // namespace ferry::internal
