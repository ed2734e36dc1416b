// File: serialization/message.h
//
// Message: what one RPC hop carries — a type, a call id, a payload of bytes (a cereal
// archive, see serialization/archive.h) and a table of tensors that travel out of
// band. A Message maps onto exactly one TensorPipe message: its buffer() is the
// TensorPipe metadata (a small header, then the payload), its tensors() the
// TensorPipe tensors.
//
//   Message m(MessageType::kRequest, /*id=*/7);
//   PayloadWriter w(m);
//   w(std::string("echo"), tensor);
//   std::string wire = m.seal();                    // header written in place
//   absl::StatusOr<Message> back = Message::parse(std::move(wire), {});
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace ferry {

enum class MessageType : uint8_t {
  kRequest = 1,   // a call: function name, signature, arguments
  kResponse = 2,  // a call's result
  kError = 3,     // a call's failure: origin worker, status code, message
  kPing = 4,      // answered by the agent itself with an empty kResponse
  kControl = 5,   // a request to the agent itself (group membership), never to user code
  kBusy = 6,      // on a reply pipe, id 0: the server is alive but stopped reading this
                  // pipe at its cap (backpressure); counts as a reply for the heartbeat
  kChunk = 7,     // a piece of a large device tensor staged through host memory, written
                  // ahead of the message that names it (agents/core/cuda_staging.h)
  kNotice = 8,    // a device channel's word to its counterpart in the peer (a copy passed,
                  // a pool refused), handled by the channel, never by the server
};

const char* message_type_name(MessageType type);

// A value type: cheap to move; copying shares the tensors' storage. Thread-compatible.
class Message {
 public:
  // Wire header: magic (2 bytes), version (1), type (1), timeout in ms (4; 0: none),
  // id (8), the size of the function's name (2; 0: none), reserved (2, zero).
  static constexpr size_t kHeaderSize = 20;
  static constexpr uint16_t kMagic = 0xFE77;
  static constexpr uint8_t kVersion = 2;
  // Where a request's function name starts in the buffer: its payload opens with the
  // name, written as cereal writes a std::string (an 8-byte size, then the bytes).
  static constexpr size_t kFunctionOffset = kHeaderSize + 8;
  // The longest name the header carries; a longer one leaves the request unnamed.
  static constexpr size_t kMaxFunctionSize = 256;
  static constexpr size_t kInitialCapacity = 128;

  Message() : Message(MessageType::kRequest, 0) {}
  // Reserves room for a small call, so that encoding one allocates exactly once.
  Message(MessageType type, uint64_t id) : type_(type), id_(id) {
    buffer_.reserve(kInitialCapacity);
    buffer_.assign(kHeaderSize, '\0');
  }

  MessageType type() const { return type_; }
  void set_type(MessageType type) { type_ = type; }
  uint64_t id() const { return id_; }
  void set_id(uint64_t id) { id_ = id; }
  // A request's timeout as its caller counts it (none: unset or zero), so that its
  // receiver can drop it unrun once the caller has given up. Longer ones saturate at
  // about 49 days.
  std::optional<std::chrono::milliseconds> timeout() const {
    if (timeout_ms_ == 0) return std::nullopt;
    return std::chrono::milliseconds(timeout_ms_);
  }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ms_ = timeout_field(timeout); }

  // The header space followed by the payload; writers append to it.
  std::string& buffer() {
    if (buffer_.empty()) buffer_.assign(kHeaderSize, '\0');  // sealed: room for a header again
    return buffer_;
  }
  const std::string& buffer() const { return buffer_; }
  // The payload without the header (empty once sealed).
  std::string_view payload() const {
    if (buffer_.size() < kHeaderSize) return {};
    return std::string_view(buffer_).substr(kHeaderSize);
  }
  std::vector<Tensor>& tensors() { return tensors_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }

  // What a request calls, for those below the rpc layer (the agent core's statistics
  // and traces) to read without decoding the payload: the header carries the name's
  // size, and the name is the payload's first field. "" when unnamed (not a request,
  // or its writer did not name it), and once sealed. A view into this message.
  std::string_view function() const {
    if (function_size_ == 0 || buffer_.size() < kFunctionOffset + function_size_) return {};
    return std::string_view(buffer_).substr(kFunctionOffset, function_size_);
  }
  // Called by a request's writer right after it wrote the name, as a string, first in
  // the payload. A name longer than kMaxFunctionSize, or a payload that does not open
  // with one of `size` bytes, leaves the request unnamed.
  void set_function_size(size_t size);

  // Writes the header into the buffer and hands the buffer out (the message keeps
  // only its tensors, and an empty buffer: writing to buffer() again starts a new
  // payload). No copy is made.
  std::string seal();
  // Rebuilds a message from a sealed buffer and the received tensors. Errors: a
  // buffer shorter than the header, a wrong magic or version, an unknown type.
  static absl::StatusOr<Message> parse(std::string wire, std::vector<Tensor> tensors);
  // Rewrites the timeout in a sealed buffer (a request held back before it is sent).
  static void reseal_timeout(std::string& wire, std::chrono::milliseconds timeout);

 private:
  // A message about to take a received buffer: nothing reserved.
  struct Received {};
  Message(Received, MessageType type, uint64_t id, std::string wire)
      : type_(type), id_(id), buffer_(std::move(wire)) {}

  MessageType type_;
  uint64_t id_;
  uint32_t timeout_ms_ = 0;
  uint16_t function_size_ = 0;

  static uint32_t timeout_field(std::chrono::milliseconds timeout) {
    if (timeout.count() <= 0) return 0;
    return timeout.count() >= int64_t{UINT32_MAX} ? UINT32_MAX : static_cast<uint32_t>(timeout.count());
  }
  std::string buffer_;
  std::vector<Tensor> tensors_;
};

}  // namespace ferry
