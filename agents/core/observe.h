// File: agents/core/observe.h
//
// The agent's side of what it lets others see: what a message is called and weighs
// (for its statistics, stats/stats.h; the call table records a made call's end, however
// it ends), a made call's trace span (trace/trace.h), and the metrics endpoint
// (metrics/). Internal to agents/core.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "agents/core/membership.h"
#include "base/future.h"
#include "metrics/metrics_server.h"
#include "serialization/message.h"
#include "stats/stats.h"
#include "store/store.h"
#include "tensor/tensor.h"
#include "trace/trace.h"

namespace ferry::internal {

// The name a call is counted under: a request's own (Message::function(), "?" when
// unnamed), "<ping>" and "<control>" for the agent's own messages. `message` is not
// sealed yet (or parsed).
std::string_view call_name(const Message& message);

// Bytes a message takes on the wire: its metadata and its tensors.
uint64_t wire_bytes(size_t metadata_bytes, const std::vector<Tensor>& tensors);


// The bytes of the device (CUDA) tensors among `tensors`, read before a channel stages
// them (staging swaps them for host copies, cuda_ipc for placeholders).
uint64_t device_tensor_bytes(const std::vector<Tensor>& tensors);
// The channels a message's device tensors took, from their targets once staged
// (agents/core/device_channel.h): "cuda_ipc", "staging", both comma-separated, or ""
// when there were none. For the trace.
std::string channels_taken(const std::vector<std::string>& targets);

// Records `call`, made to `peer` at about now with `device` tensors, in `trace` when
// `reply` completes. `trace` must outlive the reply (the agent completes every call
// before it goes).
void observe_trace(const Future<Message>& reply, TraceRecorder& trace, const PeerAddress& peer,
                   std::string_view function, uint64_t call_id, TraceDevice device = {});

// A worker's metrics endpoint and its record in the job's store (metrics/). Thread-safe.
class PublishedMetrics {
 public:
  PublishedMetrics(std::unique_ptr<MetricsServer> server, int64_t record, std::string worker, std::string prefix)
      : server_(std::move(server)), record_(record), worker_(std::move(worker)), prefix_(std::move(prefix)) {}

  // Marks the record departed (once; later calls do nothing), so that tools tell this
  // worker's leaving from its stopping to answer. The endpoint keeps answering until
  // shutdown(). A store error is logged, not returned: leaving goes on without it.
  void retire(Store& store);
  void shutdown() { server_->shutdown(); }
  const std::string& address() const { return server_->address(); }

 private:
  const std::unique_ptr<MetricsServer> server_;
  const int64_t record_;
  const std::string worker_;
  const std::string prefix_;
  std::atomic<bool> retired_{false};
};

// The worker's metrics endpoint, when asked for: `port` (an AgentOptions value), else
// FERRY_METRICS_PORT; neither: none (null). It binds FERRY_METRICS_HOST when set, else
// the address the interface resolver picks for this job (base/net.h), serves `stats`
// (which must outlive it), followed by what `more` returns (more series, in the same
// format; called on the server's thread), and is published in `store` under `prefix`
// (kMetricsStorePrefix). Errors: the resolver's, the bind's (naming the address), the
// store's.
absl::StatusOr<std::unique_ptr<PublishedMetrics>> serve_metrics(std::optional<int> port, const std::string& worker,
                                                               Store& store, const std::string& prefix,
                                                               const AgentStats& stats,
                                                               std::function<std::string()> more);

}  // namespace ferry::internal
