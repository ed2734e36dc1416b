#include "serialization/message.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry {

const char* message_type_name(MessageType type) {
  switch (type) {
    case MessageType::kRequest: return "request";
    case MessageType::kResponse: return "response";
    case MessageType::kError: return "error";
    case MessageType::kPing: return "ping";
    case MessageType::kControl: return "control";
    case MessageType::kBusy: return "busy";
  }
  return "unknown";
}

std::string Message::seal() {
  if (buffer_.size() < kHeaderSize) buffer_.assign(kHeaderSize, '\0');  // sealed before
  char* h = buffer_.data();
  std::memcpy(h, &kMagic, 2);
  h[2] = static_cast<char>(kVersion);
  h[3] = static_cast<char>(type_);
  std::memcpy(h + 4, &timeout_ms_, 4);
  std::memcpy(h + 8, &id_, 8);
  std::string out = std::move(buffer_);
  // Left empty: a fresh header would be a 16-byte allocation (past the short-string
  // buffer) per message, for a message nearly always dropped next.
  buffer_.clear();
  return out;
}

void Message::reseal_timeout(std::string& wire, std::chrono::milliseconds timeout) {
  if (wire.size() < kHeaderSize) return;
  uint32_t field = timeout_field(timeout);
  std::memcpy(wire.data() + 4, &field, 4);
}

absl::StatusOr<Message> Message::parse(std::string wire, std::vector<Tensor> tensors) {
  if (wire.size() < kHeaderSize) {
    return absl::DataLossError(absl::StrCat("message of ", wire.size(), " bytes is shorter than its ",
                                            kHeaderSize, "-byte header"));
  }
  uint16_t magic = 0;
  std::memcpy(&magic, wire.data(), 2);
  if (magic != kMagic) {
    return absl::DataLossError(absl::StrCat("message has magic 0x", absl::Hex(magic), ", expected 0x",
                                            absl::Hex(kMagic), ": not a ferry message"));
  }
  uint8_t version = static_cast<uint8_t>(wire[2]);
  if (version != kVersion) {
    return absl::FailedPreconditionError(absl::StrCat("message has wire version ", version, ", this ferry speaks ",
                                                      kVersion));
  }
  uint8_t type = static_cast<uint8_t>(wire[3]);
  if (type < 1 || type > 6) return absl::DataLossError(absl::StrCat("message has unknown type ", type));
  uint64_t id = 0;
  std::memcpy(&id, wire.data() + 8, 8);
  uint32_t timeout_ms = 0;
  std::memcpy(&timeout_ms, wire.data() + 4, 4);
  Message m(Received{}, static_cast<MessageType>(type), id, std::move(wire));
  m.timeout_ms_ = timeout_ms;
  m.tensors_ = std::move(tensors);
  return m;
}

}  // namespace ferry
