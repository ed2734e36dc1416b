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
    case MessageType::kChunk: return "chunk";
    case MessageType::kNotice: return "notice";
  }
  return "unknown";
}

namespace {

// Whether `buffer`'s payload opens with a string of `size` bytes, as cereal writes one.
bool opens_with_name(std::string_view buffer, size_t size) {
  if (buffer.size() < Message::kFunctionOffset + size) return false;
  uint64_t written = 0;  // cereal's size_type
  std::memcpy(&written, buffer.data() + Message::kHeaderSize, sizeof(written));
  return written == size;
}

}  // namespace

void Message::set_function_size(size_t size) {
  const bool named = size != 0 && size <= kMaxFunctionSize && type_ == MessageType::kRequest &&
                     opens_with_name(buffer_, size);
  function_size_ = named ? static_cast<uint16_t>(size) : 0;
}

std::string Message::seal() {
  if (buffer_.size() < kHeaderSize) buffer_.assign(kHeaderSize, '\0');  // sealed before
  char* h = buffer_.data();
  std::memcpy(h, &kMagic, 2);
  h[2] = static_cast<char>(kVersion);
  h[3] = static_cast<char>(type_);
  std::memcpy(h + 4, &timeout_ms_, 4);
  std::memcpy(h + 8, &id_, 8);
  std::memcpy(h + 16, &function_size_, 2);
  h[18] = 0;
  h[19] = 0;
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
  if (type < 1 || type > 8) return absl::DataLossError(absl::StrCat("message has unknown type ", type));
  uint64_t id = 0;
  std::memcpy(&id, wire.data() + 8, 8);
  uint32_t timeout_ms = 0;
  std::memcpy(&timeout_ms, wire.data() + 4, 4);
  uint16_t function_size = 0;
  std::memcpy(&function_size, wire.data() + 16, 2);
  if (function_size != 0 &&
      (type != static_cast<uint8_t>(MessageType::kRequest) || function_size > kMaxFunctionSize ||
       !opens_with_name(wire, function_size))) {
    return absl::DataLossError(absl::StrCat("message's header names a function of ", function_size,
                                            " bytes that its payload does not open with"));
  }
  Message m(Received{}, static_cast<MessageType>(type), id, std::move(wire));
  m.timeout_ms_ = timeout_ms;
  m.function_size_ = function_size;
  m.tensors_ = std::move(tensors);
  return m;
}

}  // namespace ferry
