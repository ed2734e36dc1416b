#include "agents/core/channels.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/session.h"
#include "base/logging.h"
#include "base/thread_role.h"
#include "base/status.h"
#include "serialization/message.h"
#include "tensor/cuda.h"

namespace ferry::internal {
namespace {

const DeviceMap* map_towards(const DeviceMaps& maps, const std::string& peer) {
  auto it = maps.find(peer);
  return it == maps.end() ? nullptr : &it->second;
}

// The local devices a worker's maps name, when it listed none itself.
std::vector<Device> devices_of(const DeviceMaps& maps, const DeviceMaps& reverse) {
  std::vector<Device> out;
  auto add = [&](Device d) {
    if (!d.is_cpu() && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& [peer, map] : maps) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  // A reverse map is keyed by this worker's devices too: {mine -> the caller's}.
  for (const auto& [peer, map] : reverse) {
    for (const auto& [mine, theirs] : map) add(mine);
  }
  return out;
}

// A worker that handles CUDA devices receives into page-locked memory: the staging
// channel lands chunks from it on the transport thread (see pin_receive_buffers).
void pin_if_cuda(const std::vector<Device>& handled) {
  if (handled.empty()) return;
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  if (runtime->device_count() > 0) pin_receive_buffers(std::move(runtime));
}

// Labels of a Prometheus series take a name as it is, but for '"' and '\\'.
std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

Channels::Channels(std::vector<std::shared_ptr<DeviceChannel>> channels, DeviceMaps device_maps,
                   DeviceMaps reverse_device_maps, const std::vector<Device>& devices, std::string required,
                   std::map<std::string, std::string> required_by_peer)
    : channels_(std::move(channels)),
      staging_(std::make_shared<CudaStaging>(devices.empty() ? devices_of(device_maps, reverse_device_maps)
                                                             : devices)),
      required_(std::move(required)),
      device_maps_(std::make_shared<const DeviceMaps>(std::move(device_maps))),
      reverse_device_maps_(std::make_shared<const DeviceMaps>(std::move(reverse_device_maps))),
      required_by_peer_(std::move(required_by_peer)) {
  pin_if_cuda(staging_->devices());
}

void Channels::attach(Core core) {
  core_ = std::move(core);
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) channel->attach(this);
}

DeviceChannel& Channels::for_peer(const PeerAddress& peer) {
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    if (channel->reaches(peer.address)) return *channel;
  }
  return *staging_;
}

std::string Channels::required_channel_to(std::string_view peer) const {
  auto it = required_by_peer_.find(std::string(peer));
  return it == required_by_peer_.end() ? required_ : it->second;
}

absl::StatusOr<DeviceChannel*> Channels::choose(const PeerAddress& peer) {
  const std::string required = required_channel_to(peer.info.name);
  if (required == staging_->name()) return staging_.get();
  DeviceChannel& chosen = for_peer(peer);
  if (required.empty() || chosen.name() == required) return &chosen;
  std::string why = "no such channel is configured in this worker";
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    if (channel->name() == required) why = channel->why_not(peer.address);
  }
  const std::string by = required_by_peer_.count(peer.info.name) != 0
                             ? absl::StrCat("set_device_channel(\"", peer.info.name, "\", ...) in the device map")
                             : std::string("FERRY_DEVICE_CHANNEL / device_channel");
  return absl::FailedPreconditionError(absl::StrCat("device tensors to worker \"", peer.info.name,
                                                    "\" would take the ", std::string(chosen.name()), " channel, but this worker requires the ",
                                                    required, " channel (", by, "): ", why));
}

void Channels::count(const std::string& peer, const std::vector<std::string>& targets) {
  if (!any_device_target(targets)) return;
  absl::MutexLock lock(&counts_->mu);
  for (const std::string& t : targets) {
    if (!t.empty()) ++counts_->by_peer[{peer, std::string(channel_of_target(t))}];
  }
}

absl::Status Channels::stage_request(const PeerAddress& peer, std::vector<Tensor>& tensors,
                                     std::vector<std::string>& targets, WriteAhead write_ahead) {
  std::shared_ptr<const DeviceMaps> maps = device_maps_.load();
  DeviceChannel* channel = staging_.get();
  for (const Tensor& t : tensors) {
    if (t.device().is_cpu()) continue;
    FERRY_ASSIGN_OR_RETURN(channel, choose(peer));
    break;
  }
  FERRY_RETURN_IF_ERROR(
      channel->stage_outgoing(tensors, targets, map_towards(*maps, peer.info.name), peer.info.name, write_ahead));
  count(peer.info.name, targets);
  return absl::OkStatus();
}

absl::Status Channels::stage_reply(const PeerAddress* member, const std::string& caller, std::vector<Tensor>& tensors,
                                   std::vector<std::string>& targets, WriteAhead write_ahead) {
  std::shared_ptr<const DeviceMaps> reverse = reverse_device_maps_.load();
  DeviceChannel* channel = staging_.get();
  if (member != nullptr) {
    for (const Tensor& t : tensors) {
      if (t.device().is_cpu()) continue;
      FERRY_ASSIGN_OR_RETURN(channel, choose(*member));
      break;
    }
  }
  FERRY_RETURN_IF_ERROR(channel->stage_outgoing(tensors, targets, map_towards(*reverse, caller), caller, write_ahead));
  count(caller, targets);
  return absl::OkStatus();
}

void Channels::forget(int peer) {
  staging_->forget(peer);
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) channel->forget(peer);
}

// A notice's payload: the channel's name, a '\0', then what that channel wrote.
void Channels::notify(int peer, std::string_view channel, std::string payload) {
  if (!core_.write) return;
  Message m(MessageType::kNotice, 0);
  m.buffer().append(channel.data(), channel.size());
  m.buffer().push_back('\0');
  m.buffer().append(payload);
  Wire wire;
  wire.metadata = m.seal();
  core_.write(peer, std::move(wire));
}

bool Channels::awaits_descriptor(const std::vector<std::string>& targets) const {
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    if (channel->awaits_descriptor(targets)) return true;
  }
  return false;
}

DeviceChannel* Channels::notice_channel(const Wire& wire, std::string_view& name, std::string_view& payload) const {
  // A notice's body: the channel's name, a NUL, what that channel said.
  std::string_view body(wire.metadata);
  body.remove_prefix(std::min(body.size(), Message::kHeaderSize));
  const size_t nul = body.find('\0');
  name = body.substr(0, nul);
  if (nul == std::string_view::npos) return nullptr;
  payload = body.substr(nul + 1);
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    if (channel->name() == name) return channel.get();
  }
  return nullptr;
}

bool Channels::notice_awaits_descriptor(int peer, const Wire& wire) const {
  std::string_view name, payload;
  DeviceChannel* channel = notice_channel(wire, name, payload);
  return channel != nullptr && channel->notice_awaits_descriptor(peer, payload);
}

void Channels::on_notice(int peer, const Wire& wire) {
  std::string_view name, payload;
  DeviceChannel* channel = notice_channel(wire, name, payload);
  if (channel == nullptr) {
    FERRY_LOG(WARNING) << "a notice from worker id " << peer << " for no channel of this worker (\"" << name << "\")";
    return;
  }
  absl::Status handled = channel->on_notice(peer, payload);
  if (!handled.ok()) FERRY_LOG(WARNING) << "a " << name << " notice from worker id " << peer << ": " << handled;
}

absl::Status Channels::pass_descriptor(int peer, uint64_t tag, int fd, std::string_view note) {
  if (!core_.pass_descriptor) return absl::FailedPreconditionError("the channels are not attached to an agent");
  return core_.pass_descriptor(peer, tag, fd, note);
}

void Channels::on_descriptor(const std::shared_ptr<Connection>& connection, uint64_t tag, int fd, std::string note) {
  absl::MutexLock lock(&held_mu_);
  size_t from_it = 0;
  for (const auto& [t, h] : held_) from_it += h.key == connection.get() ? 1 : 0;
  // Bounded: a peer may pass descriptors before it has authenticated.
  if (from_it >= kMaxHeldPerConnection || held_.count(tag) != 0) {
    if (fd >= 0) ::close(fd);
    return;
  }
  held_.emplace(tag, Held{connection, connection.get(), PassedDescriptor{fd, std::move(note)}});
  held_cv_.SignalAll();
}

void Channels::drop_descriptors(const Connection* connection) {
  absl::MutexLock lock(&held_mu_);
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second.key != connection) {
      ++it;
      continue;
    }
    if (it->second.passed.fd >= 0) ::close(it->second.passed.fd);
    it = held_.erase(it);
  }
}

absl::StatusOr<PassedDescriptor> Channels::take_descriptor(int peer, uint64_t tag, std::chrono::milliseconds wait) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(wait);
  absl::MutexLock lock(&held_mu_);
  for (;;) {
    auto it = held_.find(tag);
    if (it != held_.end()) {
      std::shared_ptr<Connection> from = it->second.from.lock();
      Session* s = from == nullptr ? nullptr : from->published_session();
      // A peer that reaches this worker on two connections (each opened its own, at once,
      // or from two pid namespaces) passes a descriptor once, on one of them, and a
      // message on the other may name it first: that one's handshake is waited for,
      // re-checked every millisecond, off the transport's threads (which run it).
      // (No session yet: the core has not taken the connection in yet.)
      const bool pending = from != nullptr && (s == nullptr || (!s->open.load(std::memory_order_acquire) &&
                                                                !s->closed.load(std::memory_order_acquire)));
      if (pending && !on_transport_thread() && absl::Now() < deadline) {
        held_cv_.WaitWithTimeout(&held_mu_, absl::Milliseconds(1));
        continue;
      }
      // Only from that peer, once it proved who it is (open is set after the peer id).
      if (s == nullptr || !s->open.load(std::memory_order_acquire) || s->peer != peer) {
        return absl::NotFoundError(absl::StrCat("descriptor ", tag, " did not come from worker id ", peer,
                                                " on a connection it authenticated"));
      }
      PassedDescriptor out = std::move(it->second.passed);
      held_.erase(it);
      return out;
    }
    if (held_cv_.WaitWithDeadline(&held_mu_, deadline)) break;
  }
  return absl::NotFoundError(absl::StrCat("descriptor ", tag, " from worker id ", peer, " did not arrive within ",
                                          wait.count(), " ms"));
}

std::function<std::string()> Channels::prometheus() const {
  return [staging = staging_, counts = counts_] {
    std::string out = staging->prometheus();
    absl::MutexLock lock(&counts->mu);
    if (!counts->by_peer.empty()) out += "# TYPE ferry_device_tensors_total counter\n";
    for (const auto& [key, n] : counts->by_peer) {
      absl::StrAppend(&out, "ferry_device_tensors_total{peer=\"", label(key.first), "\",channel=\"", key.second, "\"} ", n,
                      "\n");
    }
    return out;
  };
}

absl::Status Channels::land(std::vector<Tensor>& tensors, const std::vector<std::string>& targets) {
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    FERRY_RETURN_IF_ERROR(channel->land_incoming(tensors, targets));
  }
  return staging_->land_incoming(tensors, targets);
}

void Channels::set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices) {
  std::vector<Device> handled = devices.empty() ? devices_of(device_maps, reverse_device_maps) : std::move(devices);
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) channel->set_devices(handled);
  pin_if_cuda(handled);
  staging_->set_devices(std::move(handled));
  device_maps_.store(std::make_shared<const DeviceMaps>(std::move(device_maps)));
  reverse_device_maps_.store(std::make_shared<const DeviceMaps>(std::move(reverse_device_maps)));
}

void Channels::debug_info(std::map<std::string, std::string>& info) const {
  for (const auto& [key, value] : staging_->debug_info()) info[key] = value;
  {
    // "device_tensors.<peer>.<channel>": how many device tensors took that channel.
    absl::MutexLock lock(&counts_->mu);
    for (const auto& [key, n] : counts_->by_peer) info[absl::StrCat("device_tensors.", key.first, ".", key.second)] = absl::StrCat(n);
  }
  if (!required_.empty()) info["device_channel_required"] = required_;
  for (const auto& [peer, channel] : required_by_peer_) info[absl::StrCat("device_channel_required.", peer)] = channel;
  for (const std::shared_ptr<DeviceChannel>& channel : channels_) {
    for (const auto& [key, value] : channel->debug_info()) info[key] = value;
  }
}

}  // namespace ferry::internal

namespace ferry {

void TransportEvents::on_descriptor(const std::shared_ptr<Connection>&, uint64_t, int fd, std::string) {
  if (fd >= 0) ::close(fd);
}

}  // namespace ferry
