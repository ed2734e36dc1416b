#include "agents/cuda_ipc/cuda_ipc.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "tensor/cuda.h"
#include "tensor/cuda_streams.h"

namespace ferry {
namespace {

constexpr char kName[] = "cuda_ipc";
// Inter-process events per device, reused round robin: every record is made on the
// device's channel stream, so a wait on a later record covers an earlier one.
constexpr int kEvents = 64;
// How long a landing waits for a descriptor its message names (already on its way:
// the sender passed it before writing the message).
constexpr std::chrono::milliseconds kDescriptorWait{5000};

// Debian's Abseil has a string_view of its own.
absl::string_view av(std::string_view s) { return absl::string_view(s.data(), s.size()); }
std::string_view sv(absl::string_view s) { return std::string_view(s.data(), s.size()); }

uint64_t random_tag() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// What a tensor's target carries:
// "cuda_ipc|<sender>|<pool tag>|<events tag>|<event>|<token>|<device>|<dtype>|<shape>|<export data, hex>".
struct Descriptor {
  int sender = -1;
  uint64_t pool_tag = 0;
  uint64_t events_tag = 0;
  int event = 0;
  uint64_t token = 0;
  Device device;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  CudaPointerExport data;
};

std::string encode(const Descriptor& d) {
  return absl::StrCat(kName, "|", d.sender, "|", d.pool_tag, "|", d.events_tag, "|", d.event, "|", d.token, "|",
                      d.device.to_string(), "|", dtype_name(d.dtype), "|", absl::StrJoin(d.shape, ","), "|",
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(d.data.data),
                                                               sizeof(d.data.data))));
}

absl::StatusOr<Descriptor> decode(std::string_view text) {
  const absl::string_view target = av(text);
  std::vector<absl::string_view> f = absl::StrSplit(target, '|');
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("a cuda_ipc target with ", what, ": \"", target.substr(0, 200), "\""));
  };
  if (f.size() != 10 || f[0] != kName) return bad("the wrong number of fields");
  Descriptor d;
  if (!absl::SimpleAtoi(f[1], &d.sender) || !absl::SimpleAtoi(f[2], &d.pool_tag) ||
      !absl::SimpleAtoi(f[3], &d.events_tag) || !absl::SimpleAtoi(f[4], &d.event) || d.event < 0 ||
      !absl::SimpleAtoi(f[5], &d.token)) {
    return bad("a malformed number");
  }
  absl::StatusOr<Device> device = Device::parse(sv(f[6]));
  absl::StatusOr<DType> dtype = parse_dtype(sv(f[7]));
  if (!device.ok() || !device->is_cuda() || !dtype.ok()) return bad("a bad device or dtype");
  d.device = *device;
  d.dtype = *dtype;
  if (!f[8].empty()) {
    for (absl::string_view dim : absl::StrSplit(f[8], ',')) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(dim, &n) || n < 0) return bad("a bad shape");
      d.shape.push_back(n);
    }
  }
  std::string bytes = absl::HexStringToBytes(f[9]);
  if (f[9].size() != 2 * sizeof(d.data.data) || bytes.size() != sizeof(d.data.data)) return bad("bad export data");
  std::memcpy(d.data.data, bytes.data(), bytes.size());
  return d;
}

class CudaIpcChannel final : public DeviceChannel {
 public:
  explicit CudaIpcChannel(CudaIpcOptions options)
      : runtime_(cuda_runtime()), options_(options), streams_(runtime_) {}
  ~CudaIpcChannel() override {
    // What the streams still copy from or into is dropped only once they have passed
    // it; the streams themselves go with streams_.
    streams_.synchronize();
    absl::MutexLock lock(&mu_);
    held_.clear();
    for (auto& [peer, in] : imports_) release(in);
    for (auto& [device, events] : events_) {
      for (CudaEvent e : events) runtime_->destroy_event(e);
    }
  }

  std::string_view name() const override { return kName; }

  bool reaches(const std::string& peer_address) const override { return why_not(peer_address).empty(); }

  std::string why_not(const std::string& peer_address) const override {
    // The pool travels over the ring's socket: the peer must be one the ring reaches.
    if (peer_address.find("ring ") == std::string::npos) {
      return "it has no ring transport (its record has no ring line)";
    }
    if (options_.ring_reaches && !options_.ring_reaches(peer_address)) {
      return "it is on another host (its ring line is from another boot or network namespace)";
    }
    absl::MutexLock lock(&mu_);
    if (!exportable_.has_value()) {
      // Asked once: whether this runtime hands out its pools at all.
      if (runtime_->device_count() == 0) {
        exportable_ = absl::StrCat("this worker has no CUDA device: ", runtime_->unavailable_reason());
      } else if (absl::StatusOr<int> fd = runtime_->export_pool(0); !fd.ok()) {
        exportable_ = absl::StrCat("this worker has no IPC-capable pool: ", fd.status().message());
      } else {
        ::close(*fd);
        exportable_ = "";
      }
    }
    return *exportable_;
  }

  void attach(ChannelPort* port) override { port_ = port; }
  void set_devices(std::vector<Device> devices) override {
    absl::MutexLock lock(&mu_);
    devices_ = std::move(devices);
  }

  absl::Status stage_outgoing(std::vector<Tensor>& tensors, std::vector<std::string>& targets, const DeviceMap* map,
                              std::string_view peer, WriteAhead write_ahead) override {
    const int id = port_->peer_id(peer);
    std::map<int, std::vector<size_t>> by_device;
    std::vector<Device> landing(tensors.size());
    size_t device_bytes = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      Device device = tensors[i].device();
      if (device.is_cpu()) continue;
      auto it = map == nullptr ? DeviceMap::const_iterator() : map->find(device);
      // A tensor staging would refuse is refused there, with its words.
      if (map == nullptr || it == map->end() || !handles(device) || id < 0) {
        return port_->staging().stage_outgoing(tensors, targets, map, peer, write_ahead);
      }
      landing[i] = it->second;
      by_device[device.index()].push_back(i);
      device_bytes += tensors[i].nbytes();
    }
    if (by_device.empty()) return port_->staging().stage_outgoing(tensors, targets, map, peer, write_ahead);
    if (device_bytes < options_.min_bytes && port_->required_channel_to(peer) != kName) {
      small_staged_.fetch_add(1, std::memory_order_relaxed);
      return port_->staging().stage_outgoing(tensors, targets, map, peer, write_ahead);
    }
    {
      absl::MutexLock lock(&mu_);
      auto refused = refused_.find(id);
      if (refused != refused_.end()) return fallback(tensors, targets, map, peer, write_ahead, refused->second);
    }
    std::vector<CudaPointerExport> exports(tensors.size());
    for (auto& [device, indices] : by_device) {
      for (size_t i : indices) {
        absl::StatusOr<CudaPointerExport> x = runtime_->export_pointer(tensors[i].data());
        if (!x.ok()) {
          return fallback(tensors, targets, map, peer, write_ahead,
                          absl::StrCat("a tensor on ", Device::cuda(device).to_string(),
                                       " is not the start of a pool allocation: ", x.status().message()));
        }
        exports[i] = *x;
      }
      absl::Status passed = pass_once(id, device);
      if (!passed.ok()) {
        std::string why = absl::StrCat("its connection cannot carry a CUDA pool: ", passed.message());
        if (passed.code() == absl::StatusCode::kUnimplemented) {
          absl::MutexLock lock(&mu_);
          refused_[id] = why;
        }
        return fallback(tensors, targets, map, peer, write_ahead, why);
      }
    }
    targets.assign(tensors.size(), std::string());
    for (auto& [device, indices] : by_device) {
      FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device));
      // The receiver copies after what the producer queued before the call.
      FERRY_RETURN_IF_ERROR(order_after(stream, current_cuda_stream(device)));
      const int event = next_event(device);
      Descriptor d;
      d.sender = port_->self_id();
      {
        absl::MutexLock lock(&mu_);
        const Passed& p = passed_[{id, device}];
        d.pool_tag = p.pool_tag;
        d.events_tag = p.events_tag;
        FERRY_RETURN_IF_ERROR(runtime_->record(events_[device][static_cast<size_t>(event)], stream));
      }
      d.event = event;
      for (size_t i : indices) {
        d.token = next_token_.fetch_add(1) + 1;
        d.device = landing[i];
        d.dtype = tensors[i].dtype();
        d.shape = tensors[i].shape();
        d.data = exports[i];
        targets[i] = encode(d);
        {
          absl::MutexLock lock(&mu_);
          held_[id].emplace(d.token, tensors[i]);
          ++sent_;
        }
        tensors[i] = *Tensor::empty({0}, DType::kUInt8);
      }
    }
    return absl::OkStatus();
  }

  absl::Status land_incoming(std::vector<Tensor>& tensors, const std::vector<std::string>& targets) override {
    // By sender and landing device: one wait per sender event, one record of ours.
    std::map<std::pair<int, int>, std::vector<std::pair<size_t, Descriptor>>> groups;
    for (size_t i = 0; i < tensors.size() && i < targets.size(); ++i) {
      if (targets[i].empty() || channel_of_target(targets[i]) != kName) continue;
      FERRY_ASSIGN_OR_RETURN(Descriptor d, decode(targets[i]));
      if (!handles(d.device)) {
        return absl::InvalidArgumentError(absl::StrCat("a received tensor could not be placed on ",
                                                       d.device.to_string(), ": this worker does not handle it"));
      }
      groups[{d.sender, d.device.index()}].emplace_back(i, std::move(d));
    }
    for (auto& [key, items] : groups) {
      const auto [sender, device] = key;
      std::vector<uint64_t> tokens;
      for (const auto& [i, d] : items) tokens.push_back(d.token);
      absl::StatusOr<Imported> imported = import_once(sender, device, items.front().second);
      if (!imported.ok()) {
        port_->notify(sender, kName, absl::StrCat("refused\n", absl::StrJoin(tokens, " "), "\n",
                                                  imported.status().message()));
        return absl::FailedPreconditionError(absl::StrCat("worker id ", port_->self_id(),
                                                          " refused CUDA IPC from worker id ", sender, ": ",
                                                          imported.status().message()));
      }
      FERRY_ASSIGN_OR_RETURN(CudaStream stream, stream_for(device));
      std::vector<Tensor> landed;
      for (const auto& [i, d] : items) {
        FERRY_ASSIGN_OR_RETURN(Tensor t, Tensor::empty(d.shape, d.dtype, d.device));
        landed.push_back(std::move(t));
      }
      // After the allocations (on the default stream), and after the sender's producer.
      FERRY_RETURN_IF_ERROR(order_after(stream, CudaStream{device, nullptr}));
      absl::Status copied = copy_in(*imported, items, landed, stream);
      if (!copied.ok()) {
        // The landed tensors go back to the pool on the default stream, after what was queued.
        (void)order_after(CudaStream{device, nullptr}, stream);
        return copied;
      }
      for (size_t k = 0; k < items.size(); ++k) tensors[items[k].first] = std::move(landed[k]);
      // Ours, recorded after the copies, for the sender; and the tensors are ready on
      // the default stream.
      FERRY_RETURN_IF_ERROR(pass_once(sender, device));
      const int event = next_event(device);
      uint64_t events_tag = 0;
      {
        absl::MutexLock lock(&mu_);
        events_tag = passed_[{sender, device}].events_tag;
        FERRY_RETURN_IF_ERROR(runtime_->record(events_[device][static_cast<size_t>(event)], stream));
        landed_ += items.size();
      }
      FERRY_RETURN_IF_ERROR(order_after(CudaStream{device, nullptr}, stream));
      port_->notify(sender, kName, absl::StrCat("done\n", absl::StrJoin(tokens, " "), "\n", events_tag, " ", event));
    }
    return absl::OkStatus();
  }

  bool awaits_descriptor(const std::vector<std::string>& targets) const override {
    absl::MutexLock lock(&mu_);
    for (const std::string& target : targets) {
      if (target.empty() || channel_of_target(target) != kName) continue;
      absl::StatusOr<Descriptor> d = decode(target);
      if (!d.ok()) continue;  // refused by land_incoming, at once
      auto in = imports_.find(d->sender);
      if (in == imports_.end() || in->second.pools.count(d->pool_tag) == 0 ||
          in->second.events.count(d->events_tag) == 0) {
        return true;
      }
    }
    return false;
  }

  bool notice_awaits_descriptor(int peer, std::string_view text) const override {
    // "done\n<tokens>\n<events tag> <event>": the events, imported once.
    std::vector<absl::string_view> lines = absl::StrSplit(av(text), absl::MaxSplits('\n', 2));
    uint64_t events_tag = 0;
    if (lines.size() != 3 || lines[0] != "done" ||
        !absl::SimpleAtoi(lines[2].substr(0, lines[2].find(' ')), &events_tag)) {
      return false;
    }
    absl::MutexLock lock(&mu_);
    auto in = imports_.find(peer);
    return in == imports_.end() || in->second.events.count(events_tag) == 0;
  }

  absl::Status on_notice(int peer, std::string_view text) override {
    std::vector<absl::string_view> lines = absl::StrSplit(av(text), absl::MaxSplits('\n', 2));
    if (lines.size() != 3) return absl::DataLossError("a cuda_ipc notice without its three lines");
    std::vector<uint64_t> tokens;
    for (absl::string_view t : absl::StrSplit(lines[1], ' ', absl::SkipEmpty())) {
      uint64_t token = 0;
      if (!absl::SimpleAtoi(t, &token)) return absl::DataLossError("a cuda_ipc notice with a bad token");
      tokens.push_back(token);
    }
    std::vector<Tensor> released;
    // Notices may be handled on two threads at once (on the pool, when
    // notice_awaits_descriptor): one imports the peer's events, as import_once does,
    // while the other waits for it rather than for a descriptor that was taken already.
    absl::MutexLock setup(&import_mu_);
    absl::MutexLock lock(&mu_);
    if (lines[0] == "refused") {
      refused_[peer] = absl::StrCat("it refused to import: ", lines[2]);
      take_held(peer, tokens, released);
      return absl::OkStatus();
    }
    if (lines[0] != "done") return absl::DataLossError(absl::StrCat("a cuda_ipc notice of kind ", lines[0]));
    std::vector<absl::string_view> ev = absl::StrSplit(lines[2], ' ');
    uint64_t events_tag = 0;
    int event = 0;
    if (ev.size() != 2 || !absl::SimpleAtoi(ev[0], &events_tag) || !absl::SimpleAtoi(ev[1], &event) || event < 0 ||
        event >= kEvents) {
      return absl::DataLossError("a cuda_ipc notice with a bad event");
    }
    take_held(peer, tokens, released);
    // The peer's events, passed before the notice; imported here once.
    std::set<int> devices;
    for (const Tensor& t : released) devices.insert(t.device().index());
    for (int device : devices) {
      absl::StatusOr<std::vector<CudaEvent>*> theirs = their_events(peer, device, events_tag);
      if (!theirs.ok()) {
        // Never free what the peer may still read: keep the tensors until it is lost.
        for (Tensor& t : released) kept_[peer].push_back(std::move(t));
        return theirs.status();
      }
      // The memory returns to the pool on the default stream, after the peer's copy.
      FERRY_RETURN_IF_ERROR(runtime_->wait(CudaStream{device, nullptr}, (**theirs)[static_cast<size_t>(event)]));
    }
    ++notices_;
    // `released` goes at the end of this scope, under mu_: their frees are queued now.
    return absl::OkStatus();
  }

  void forget(int peer) override {
    std::vector<Tensor> dropped;
    absl::MutexLock lock(&mu_);
    if (auto it = held_.find(peer); it != held_.end()) {
      for (auto& [token, t] : it->second) dropped.push_back(std::move(t));
      held_.erase(it);
    }
    kept_.erase(peer);
    if (auto it = imports_.find(peer); it != imports_.end()) {
      release(it->second);
      imports_.erase(it);
    }
    for (auto it = passed_.begin(); it != passed_.end();) it = it->first.first == peer ? passed_.erase(it) : std::next(it);
    refused_.erase(peer);
  }

  std::map<std::string, std::string> debug_info() const override {
    absl::MutexLock lock(&mu_);
    std::map<std::string, std::string> info;
    size_t held = 0;
    for (const auto& [peer, tokens] : held_) held += tokens.size();
    info["cuda_ipc_exports"] = absl::StrCat(exports_);
    info["cuda_ipc_imports"] = absl::StrCat(imports_count_);
    info["cuda_ipc_tensors_sent"] = absl::StrCat(sent_);
    info["cuda_ipc_tensors_landed"] = absl::StrCat(landed_);
    info["cuda_ipc_tensors_held"] = absl::StrCat(held);
    info["cuda_ipc_notices"] = absl::StrCat(notices_);
    info["cuda_ipc_min_bytes"] = absl::StrCat(options_.min_bytes);
    info["cuda_ipc_small_messages_staged"] = absl::StrCat(small_staged_.load(std::memory_order_relaxed));
    for (const auto& [peer, why] : refused_) info[absl::StrCat("cuda_ipc_refused.", peer)] = why;
    return info;
  }

 private:
  // What was passed to one peer for one device: the pool's tag and our events' tag.
  struct Passed {
    uint64_t pool_tag = 0;
    uint64_t events_tag = 0;
  };
  // What one sender passed us: its pools and its events, by tag.
  struct FromPeer {
    std::map<uint64_t, CudaImportedPool> pools;
    std::map<uint64_t, std::vector<CudaEvent>> events;
  };
  struct Imported {
    CudaImportedPool pool;
    const std::vector<CudaEvent>* events = nullptr;
  };

  // Queues on `stream`, for each item, the wait for the sender's event (once per
  // event), the copy into its landed tensor, and the release of the imported pointer.
  absl::Status copy_in(const Imported& imported, const std::vector<std::pair<size_t, Descriptor>>& items,
                       std::vector<Tensor>& landed, CudaStream stream) {
    std::set<int> waited;
    for (size_t k = 0; k < items.size(); ++k) {
      const Descriptor& d = items[k].second;
      if (d.event >= static_cast<int>(imported.events->size())) {
        return absl::DataLossError(
            absl::StrCat("a cuda_ipc target names event ", d.event, " of ", imported.events->size()));
      }
      if (waited.insert(d.event).second) {
        FERRY_RETURN_IF_ERROR(runtime_->wait(stream, (*imported.events)[static_cast<size_t>(d.event)]));
      }
      FERRY_ASSIGN_OR_RETURN(void* src, runtime_->import_pointer(imported.pool, d.data));
      FERRY_RETURN_IF_ERROR(runtime_->copy_async(landed[k].data(), d.device, src, d.device, landed[k].nbytes(), stream));
      FERRY_RETURN_IF_ERROR(runtime_->release_imported_pointer(src, stream));
    }
    return absl::OkStatus();
  }

  // Moves the tensors held for `peer` under `tokens` (those still held) into `out`.
  void take_held(int peer, const std::vector<uint64_t>& tokens, std::vector<Tensor>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto held = held_.find(peer);
    if (held == held_.end()) return;
    for (uint64_t token : tokens) {
      auto it = held->second.find(token);
      if (it == held->second.end()) continue;
      out.push_back(std::move(it->second));
      held->second.erase(it);
    }
  }

  void release(FromPeer& in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto& [tag, pool] : in.pools) runtime_->release_imported_pool(pool);
    for (auto& [tag, events] : in.events) {
      for (CudaEvent e : events) runtime_->destroy_event(e);  // a stream waiting on one goes on
    }
    in = FromPeer();
  }

  bool handles(Device device) const {
    absl::MutexLock lock(&mu_);
    return devices_.empty() || std::find(devices_.begin(), devices_.end(), device) != devices_.end();
  }

  absl::Status fallback(std::vector<Tensor>& tensors, std::vector<std::string>& targets, const DeviceMap* map,
                        std::string_view peer, WriteAhead write_ahead, const std::string& why) {
    if (port_->required_channel_to(peer) == kName) {
      return absl::FailedPreconditionError(absl::StrCat("device tensors to worker \"", av(peer),
                                                        "\" cannot go device to device, and this worker requires the "
                                                        "cuda_ipc channel to it (FERRY_DEVICE_CHANNEL / device_channel, "
                                                        "or set_device_channel for that worker): ", why));
    }
    return port_->staging().stage_outgoing(tensors, targets, map, peer, write_ahead);
  }

  absl::StatusOr<CudaStream> stream_for(int device) { return streams_.get(device); }
  absl::Status order_after(CudaStream waiter, CudaStream signaller) {
    return ferry::order_after(*runtime_, waiter, signaller);
  }

  int next_event(int device) {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(next_event_[device]++ % kEvents);
  }

  // This device's pool and events, passed to `peer` once (under setup_mu_, so once).
  absl::Status pass_once(int peer, int device) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock setup(&setup_mu_);
    {
      absl::MutexLock lock(&mu_);
      if (passed_.count({peer, device}) != 0) return absl::OkStatus();
      if (events_.count(device) == 0) {
        FERRY_ASSIGN_OR_RETURN(std::vector<CudaEvent> events, runtime_->create_ipc_events(device, kEvents));
        events_.emplace(device, std::move(events));
      }
    }
    FERRY_ASSIGN_OR_RETURN(int pool_fd, runtime_->export_pool(device));
    Passed p{random_tag(), random_tag()};
    absl::Status sent = port_->pass_descriptor(peer, p.pool_tag, pool_fd, "");
    ::close(pool_fd);
    FERRY_RETURN_IF_ERROR(sent);
    absl::StatusOr<CudaIpcEvents> events;
    {
      absl::MutexLock lock(&mu_);
      events = runtime_->export_ipc_events(events_[device]);
    }
    if (!events.ok()) return events.status();
    sent = port_->pass_descriptor(peer, p.events_tag, events->fd, events->handles);
    if (events->fd >= 0) ::close(events->fd);
    FERRY_RETURN_IF_ERROR(sent);
    absl::MutexLock lock(&mu_);
    ++exports_;
    passed_[{peer, device}] = p;
    return absl::OkStatus();
  }

  // The pool and events that `sender` passed with `d`'s tags, imported once.
  absl::StatusOr<Imported> import_once(int sender, int device, const Descriptor& d) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock setup(&import_mu_);
    {
      absl::MutexLock lock(&mu_);
      FromPeer& in = imports_[sender];
      auto pool = in.pools.find(d.pool_tag);
      auto events = in.events.find(d.events_tag);
      if (pool != in.pools.end() && events != in.events.end()) return Imported{pool->second, &events->second};
    }
    CudaImportedPool pool;
    bool have_pool = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = imports_[sender].pools.find(d.pool_tag);
      if (it != imports_[sender].pools.end()) {
        pool = it->second;
        have_pool = true;
      }
    }
    if (!have_pool) {
      FERRY_ASSIGN_OR_RETURN(PassedDescriptor passed, port_->take_descriptor(sender, d.pool_tag, kDescriptorWait));
      absl::StatusOr<CudaImportedPool> opened = runtime_->import_pool(passed.fd);
      if (passed.fd >= 0) ::close(passed.fd);
      if (!opened.ok()) return opened.status();
      pool = *opened;
      absl::MutexLock lock(&mu_);
      imports_[sender].pools.emplace(d.pool_tag, pool);
      ++imports_count_;
    }
    FERRY_ASSIGN_OR_RETURN(std::vector<CudaEvent>* events, their_events_unlocked(sender, device, d.events_tag));
    return Imported{pool, events};
  }

  absl::StatusOr<std::vector<CudaEvent>*> their_events_unlocked(int peer, int device, uint64_t tag)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return their_events(peer, device, tag);
  }

  // `peer`'s events passed with `tag`, opened on `device` at first use.
  absl::StatusOr<std::vector<CudaEvent>*> their_events(int peer, int device, uint64_t tag)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FromPeer& in = imports_[peer];
    auto it = in.events.find(tag);
    if (it != in.events.end()) return &it->second;
    // Passed ahead of whatever names it: there, or a moment away.
    mu_.Unlock();
    absl::StatusOr<PassedDescriptor> passed = port_->take_descriptor(peer, tag, kDescriptorWait);
    absl::StatusOr<std::vector<CudaEvent>> opened =
        passed.ok() ? runtime_->import_ipc_events(device, passed->fd, passed->note) : passed.status();
    if (passed.ok() && passed->fd >= 0) ::close(passed->fd);
    mu_.Lock();
    if (!opened.ok()) return opened.status();
    if (opened->size() != static_cast<size_t>(kEvents)) {
      for (CudaEvent e : *opened) runtime_->destroy_event(e);
      return absl::DataLossError(absl::StrCat("worker id ", peer, " passed ", opened->size(), " events, not ", kEvents));
    }
    return &(imports_[peer].events[tag] = *std::move(opened));
  }

  const std::shared_ptr<CudaRuntime> runtime_;
  const CudaIpcOptions options_;
  CudaStreams streams_;          // the channel's stream per device
  ChannelPort* port_ = nullptr;  // set by attach(), before any call
  std::atomic<uint64_t> next_token_{0};
  std::atomic<uint64_t> small_staged_{0};  // messages under min_bytes, handed to staging
  absl::Mutex setup_mu_;   // one pass_once at a time (ordered before mu_)
  absl::Mutex import_mu_;  // one import (import_once, a notice's) at a time; before mu_
  mutable absl::Mutex mu_;
  mutable std::optional<std::string> exportable_ ABSL_GUARDED_BY(mu_);  // "" when it can export
  std::vector<Device> devices_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::vector<CudaEvent>> events_ ABSL_GUARDED_BY(mu_);      // ours, by device
  std::map<int, uint64_t> next_event_ ABSL_GUARDED_BY(mu_);                // by device
  std::map<std::pair<int, int>, Passed> passed_ ABSL_GUARDED_BY(mu_);      // by (peer, device)
  std::map<int, FromPeer> imports_ ABSL_GUARDED_BY(mu_);                   // by sender
  std::map<int, std::map<uint64_t, Tensor>> held_ ABSL_GUARDED_BY(mu_);    // by peer, token
  std::map<int, std::vector<Tensor>> kept_ ABSL_GUARDED_BY(mu_);           // by peer: until it is lost
  std::map<int, std::string> refused_ ABSL_GUARDED_BY(mu_);                // by peer: why staging instead
  uint64_t exports_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t imports_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t landed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t notices_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<CudaIpcOptions> CudaIpcOptions::from_environment() {
  CudaIpcOptions options;
  const char* v = std::getenv("FERRY_CUDA_IPC_MIN_BYTES");
  if (v == nullptr || *v == '\0') return options;
  uint64_t bytes = 0;
  if (!absl::SimpleAtoi(v, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("FERRY_CUDA_IPC_MIN_BYTES=\"", v,
                                                   "\": expected a number of bytes (0: every message takes cuda_ipc)"));
  }
  options.min_bytes = static_cast<size_t>(bytes);
  return options;
}

std::shared_ptr<DeviceChannel> make_cuda_ipc_channel(CudaIpcOptions options) {
  return std::make_shared<CudaIpcChannel>(options);
}

}  // namespace ferry
