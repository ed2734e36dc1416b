// File: agents/core/observe.h
//
// The agent's side of its statistics (stats/stats.h): what a message is called and
// weighs, and a made call's completion recorded whatever ends it (reply, error,
// timeout, lost peer, shutdown). Internal to agents/core.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/future.h"
#include "serialization/message.h"
#include "stats/stats.h"
#include "tensor/tensor.h"

namespace ferry::internal {

// The name a call is counted under: the function of an rpc-layer request, "<ping>" and
// "<control>" for the agent's own messages. `message` is not sealed yet (or parsed).
std::string_view call_name(const Message& message);

// Bytes a message takes on the wire: its metadata and its tensors.
uint64_t wire_bytes(size_t metadata_bytes, const std::vector<Tensor>& tensors);

// Records `call` finished when `reply` completes, on whichever thread completes it.
void observe_reply(const Future<Message>& reply, AgentStats::Call call);

}  // namespace ferry::internal
