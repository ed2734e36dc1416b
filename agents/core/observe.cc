#include "agents/core/observe.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agents/core/device_channel.h"
#include "base/env.h"
#include "base/logging.h"
#include "base/net.h"
#include "base/status.h"
#include "stats/prometheus.h"
#include "store/store_host.h"

namespace ferry::internal {

std::string_view call_name(const Message& message) {
  switch (message.type()) {
    case MessageType::kPing:
      return "<ping>";
    case MessageType::kControl:
      return "<control>";
    default: {
      const std::string_view fn = message.function();
      return fn.empty() ? std::string_view("?") : fn;
    }
  }
}

uint64_t wire_bytes(size_t metadata_bytes, const std::vector<Tensor>& tensors) {
  uint64_t n = metadata_bytes;
  for (const Tensor& t : tensors) n += t.nbytes();
  return n;
}

uint64_t device_tensor_bytes(const std::vector<Tensor>& tensors) {
  uint64_t n = 0;
  for (const Tensor& t : tensors) n += t.device().is_cpu() ? 0 : t.nbytes();
  return n;
}

std::string channels_taken(const std::vector<std::string>& targets) {
  std::vector<std::string_view> seen;  // in the order they first appear
  std::string out;
  for (const std::string& t : targets) {
    if (t.empty()) continue;
    const std::string_view channel = channel_of_target(t);
    if (std::find(seen.begin(), seen.end(), channel) != seen.end()) continue;
    seen.push_back(channel);
    if (!out.empty()) out += ',';
    out += channel;
  }
  return out;
}

void observe_trace(const Future<Message>& reply, TraceRecorder& trace, const PeerAddress& peer,
                   std::string_view function, uint64_t call_id, TraceDevice device) {
  reply.add_inline_callback([&trace, peer_id = peer.info.id, peer_name = peer.info.name, fn = std::string(function),
                             call_id, sent = TraceRecorder::Clock::now(),
                             device = std::move(device)](const absl::StatusOr<Message>&) {
    trace.call(peer_id, peer_name, fn, call_id, sent, TraceRecorder::Clock::now(), device);
  });
}

void PublishedMetrics::retire(Store& store) {
  if (retired_.exchange(true)) return;
  absl::Status marked = retire_metrics_endpoint(store, prefix_, record_, worker_, server_->address());
  if (!marked.ok()) FERRY_LOG(WARNING) << worker_ << ": could not mark its metrics endpoint departed: " << marked;
}

absl::StatusOr<std::unique_ptr<PublishedMetrics>> serve_metrics(std::optional<int> port, const std::string& worker,
                                                               Store& store, const std::string& prefix,
                                                               const AgentStats& stats,
                                                               std::function<std::string()> more) {
  if (!port.has_value()) {
    const int64_t from_env = env_int("FERRY_METRICS_PORT", -1, 0, 65535);
    if (from_env < 0) return nullptr;
    port = static_cast<int>(from_env);
  }
  MetricsServer::Options options;
  options.port = *port;
  if (std::optional<std::string> host = env_string("FERRY_METRICS_HOST")) {
    options.host = *host;
  } else {
    FERRY_ASSIGN_OR_RETURN(ListenAddress where, resolve_listen_address(std::nullopt, store_host_of(store)));
    options.host = where.host;
  }
  const AgentStats* source = &stats;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::start(options, [source, more = std::move(more)] {
        std::string text = to_prometheus(source->snapshot());
        if (more) text += more();
        return text;
      });
  if (!server.ok()) {
    return absl::Status(server.status().code(), absl::StrCat(worker, ": ", server.status().message()));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t record, publish_metrics_endpoint(store, prefix, worker, (*server)->address()));
  FERRY_LOG(INFO) << worker << ": metrics at http://" << (*server)->address() << "/metrics";
  return std::make_unique<PublishedMetrics>(*std::move(server), record, worker, prefix);
}

}  // namespace ferry::internal
