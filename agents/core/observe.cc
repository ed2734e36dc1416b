#include "agents/core/observe.h"

namespace ferry::internal {

std::string_view call_name(const Message& message) {
  switch (message.type()) {
    case MessageType::kPing:
      return "<ping>";
    case MessageType::kControl:
      return "<control>";
    default:
      return function_of_payload(message.payload());
  }
}

uint64_t wire_bytes(size_t metadata_bytes, const std::vector<Tensor>& tensors) {
  uint64_t n = metadata_bytes;
  for (const Tensor& t : tensors) n += t.nbytes();
  return n;
}

void observe_reply(const Future<Message>& reply, AgentStats::Call call) {
  if (call.cell == nullptr) return;
  // Captures only the 16-byte record, which std::function keeps without allocating.
  reply.add_inline_callback([call](const absl::StatusOr<Message>& result) {
    AgentStats::call_finished(call, result.status().code(),
                              result.ok() ? wire_bytes(result->buffer().size(), result->tensors()) : 0);
  });
}

}  // namespace ferry::internal
